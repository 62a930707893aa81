import torch, time
from kvtier.gpu_pool.kernels import triton_codec
from kvtier.kv_codecs import encode, Codec, groups, layer_exponents_at
L,T,H,D=32,256,8,128
kv = torch.randn(L,2,T,H,D).to(torch.bfloat16)
pool = torch.zeros(L,64,2,16,H,D,dtype=torch.bfloat16,device="cuda")
ids = torch.arange(16,device="cuda")
raw = kv.cuda().contiguous(); dst = torch.empty_like(raw)
st = torch.zeros(1, dtype=torch.int32, device="cuda")
def t(fn, n=30):
    fn(); torch.cuda.synchronize(); a=time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter()-a)/n
c = t(lambda: dst.copy_(raw)); nb = raw.numel()*2
print(f"d2d copy {nb/c/1e9:.0f} GB/s")
for codec in (Codec.FP8, Codec.INT8, Codec.INT4):
    p = torch.cat([encode(kv[i:i+1], codec) for i in range(L)]).cuda()
    at = layer_exponents_at(codec, (2,T,H,D), torch.bfloat16)
    for rows in (1, 4, 8, 16):
        for w in (4, 8):
            s = t(lambda: triton_codec.decode_scatter(p, codec.value, pool, ids, T, 0, at, groups(codec,T,D), st, rows, w))
            print(f"{codec.value} rows={rows} warps={w}: {nb/s/1e9:.0f} GB/s ({nb/s/c/1e9*1e9/ (nb/1):.3f})".replace("({", "(").split(" (")[0], f"{(c/s):.2f}x copy")
