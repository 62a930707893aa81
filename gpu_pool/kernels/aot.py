"""Compile the Triton kernels for a CUDA target without a GPU.

The interpreter checks what the kernels compute, not whether Triton can lower them for a
real GPU; this does the lowering (TTIR -> PTX -> cubin with the ptxas shipped in the Triton
wheel) for the launch configurations the launchers use, and reports shared memory and, with
``--ptxas-report``, registers and spills. A CI check for machines without a GPU; it uses
Triton's compiler API (``ASTSource``, ``GPUTarget``), which is less stable than ``tl``.

    TRITON_INTERPRET=0 python -m kvtier.gpu_pool.kernels.aot --arch 90
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from kvtier.chunk_format import DTYPES

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _signature(fn: Any, consts: dict[str, Any], types: dict[str, str]) -> dict[str, str]:
    """Every argument: pointers and floats from ``types``, constexprs, the rest i32."""
    return {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}


def configs(dtype: torch.dtype, head_dim: int, group: int, block_size: int
            ) -> Iterator[tuple[str, Any, dict[str, str], dict[str, Any], dict[str, int]]]:
    """(label, kernel, signature, constexprs, options) for each launch the launchers make."""
    from kvtier.gpu_pool.kernels import (
        triton_blocks,
        triton_decode,
        triton_kv_write,
        triton_prefill,
    )
    from kvtier.gpu_pool.kernels.triton_common import dot_options

    t = f"*{TYPES[dtype]}"
    dec = triton_decode.launch_config(dtype, head_dim, group, block_size)
    opts = {"num_warps": dec.pop("num_warps"), "num_stages": dec.pop("num_stages")}
    for split in (False, True):
        consts = {**dec, "SPLIT": split}
        types = {"q_ptr": t, "kv_ptr": t, "bt_ptr": "*i32", "lens_ptr": "*i32",
                 "out_ptr": "*fp32" if split else t, "m_ptr": "*fp32", "l_ptr": "*fp32",
                 "scale_log2e": "fp32"}
        fn = triton_decode.decode_kernel
        yield f"decode split={split}", fn, _signature(fn, consts, types), consts, opts
    fn = triton_decode.reduce_kernel
    consts = {"HEAD_DIM": head_dim, "BLOCK_D": dec["BLOCK_D"], "BLOCK_S": 16}
    types = {"part_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "out_ptr": t}
    yield "decode reduce", fn, _signature(fn, consts, types), consts, {"num_warps": 4}

    tiles = triton_prefill.tile_config(dtype, head_dim)
    consts = {"GROUP": group, "HEAD_DIM": head_dim, "BLOCK_D": dec["BLOCK_D"],
              "BLOCK_SIZE": block_size, "BLOCK_M": tiles["BLOCK_M"],
              "BLOCK_N": tiles["BLOCK_N"], **dot_options(dtype)}
    types = {"q_ptr": t, "kv_ptr": t, "bt_ptr": "*i32", "lens_ptr": "*i32", "cu_ptr": "*i32",
             "out_ptr": t, "scale_log2e": "fp32"}
    fn = triton_prefill.prefill_kernel
    yield "prefill", fn, _signature(fn, consts, types), consts, {
        "num_warps": tiles["num_warps"], "num_stages": 2}

    fn = triton_blocks.blocks_copy_kernel
    for to_pool in (False, True):
        consts = {"BLOCK_SIZE": block_size, "TILE": triton_blocks.TILE, "TO_POOL": to_pool}
        types = {"kv_ptr": t, "buf_ptr": t, "ids_ptr": "*i64"}
        yield f"blocks to_pool={to_pool}", fn, _signature(fn, consts, types), consts, {
            "num_warps": 4}

    fn = triton_kv_write.kv_write_kernel
    consts = {"NUM_HEADS": 8, "HEAD_DIM": head_dim, "BLOCK_H": 8,
              "BLOCK_D": dec["BLOCK_D"], "BLOCK_SIZE": block_size}
    types = {"key_ptr": t, "value_ptr": t, "kv_ptr": t, "slot_ptr": "*i64"}
    yield "kv write", fn, _signature(fn, consts, types), consts, {"num_warps": 4}


def _ptxas_report(ptx: str, arch: int) -> str:
    """Registers and spills from ``ptxas -v`` (the newest ptxas the Triton wheel ships)."""
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    candidates = [os.path.join(bin_dir, n) for n in ("ptxas-blackwell", "ptxas")]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        for exe in candidates:
            if not os.path.exists(exe):
                continue
            gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
            out = subprocess.run([exe, "-v", f"--gpu-name={gpu}", f.name, "-o", os.devnull],
                                 capture_output=True, text=True, timeout=300)
            if out.returncode == 0:
                lines = [ln.split(":", 1)[-1].strip() for ln in out.stderr.splitlines()
                         if "spill" in ln or "registers" in ln]
                return " | ".join(lines)
        return "ptxas report unavailable"
    finally:
        os.unlink(f.name)


def compile_all(arch: int, dtypes: list[torch.dtype], head_dims: list[int],
                ptxas_report: bool = False) -> list[dict[str, Any]]:
    """Compile every kernel configuration for ``sm_<arch>``; raises on the first failure."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    results = []
    for dtype in dtypes:
        for head_dim in head_dims:
            for label, fn, sig, consts, opts in configs(dtype, head_dim, 4, 16):
                src = ASTSource(fn, sig, constexprs=consts)
                kernel = triton.compile(src, target=target, options=opts)
                row = {"kernel": label, "dtype": TYPES[dtype], "head_dim": head_dim,
                       "shared_bytes": kernel.metadata.shared}
                if ptxas_report:
                    row["ptxas"] = _ptxas_report(kernel.asm["ptx"], arch)
                results.append(row)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    p.add_argument("--dtype", action="append", choices=sorted(DTYPES),
                   help="KV dtype (repeatable; default all)")
    p.add_argument("--head-dim", action="append", type=int,
                   help="head dim (repeatable; default 64 and 128)")
    p.add_argument("--ptxas-report", action="store_true", help="registers and spills")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter does not compile", file=sys.stderr)
        return 2
    dtypes = [DTYPES[d] for d in (args.dtype or sorted(DTYPES))]
    for row in compile_all(args.arch, dtypes, args.head_dim or [64, 128], args.ptxas_report):
        extra = f"  {row['ptxas']}" if "ptxas" in row else ""
        print(f"sm_{args.arch} {row['dtype']:>4} d={row['head_dim']:<3} {row['kernel']:<22} "
              f"ok  shared {row['shared_bytes']:>6} B{extra}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
