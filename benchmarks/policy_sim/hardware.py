"""Cost profiles for the machines users serve on, modelled from datasheets and checked
against published measurements: H100-SXM and A100 with Llama-3-8B and Llama-3-70B (TP 4/8),
and an L4 with an 8B model.

A profile is the same :class:`~kvtier.policies.cost_model.CostModel` that ``kvtier
calibrate`` measures on one's own machine, built here from first principles:

- **Prefill** of ``new`` tokens after ``cached``: the weights' work, ``2 x params`` FLOPs a
  token, plus attention's ``4 x layers x q_heads x head_dim`` FLOPs per (token, context
  token) pair (QK^T and AV), at the GPUs' dense BF16 peak times a stated MFU (and a tensor
  parallel efficiency for TP > 1); a fixed overhead of one pass over the weights at HBM
  speed plus launch costs.
- **Decode**: one pass over the weights (and the context's KV) per token at HBM speed
  times an efficiency (recorded; TTFT does not include it).
- **KV bytes per token**: ``2 x layers x kv_heads x head_dim x 2`` (BF16), from the config.
- **Tiers**: the CPU tier over PCIe (pinned H2D read, D2H write), the disk tier on one
  datacenter NVMe drive, Redis (or any remote store) over a 25 or 100 GbE link.

Every constant names its source (``SOURCES``), and every profile carries checks: its
prediction next to a published measurement, so a reader sees how far the model is from
the real thing. These are models, not measurements: ``kvtier calibrate`` on the GPU stays
the way to profile one's own machine, and the profiles say so (``"modelled": true``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import InvalidArgumentError
from kvtier.policies.cost_model import CostModel, LinearCost, PrefillCost, TierCost

GB = 1e9


@dataclass(frozen=True)
class Source:
    what: str
    value: str
    url: str


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float
    """Dense BF16 tensor peak (no sparsity)."""
    hbm_GBps: float
    memory_GB: float
    pcie_h2d_GBps: float
    """Measured pinned host-to-device copy bandwidth of its PCIe link."""
    pcie_d2h_GBps: float
    sources: tuple[str, ...]


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    source: str

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, BF16

    @property
    def attn_flops_per_pair(self) -> float:
        return 4.0 * self.layers * self.q_heads * self.head_dim


@dataclass(frozen=True)
class Storage:
    name: str
    read_GBps: float
    write_GBps: float
    read_latency_s: float
    write_latency_s: float
    source: str


@dataclass(frozen=True)
class Check:
    """A published measurement the profile should come near: prefill (or TTFT at low
    load) of ``tokens`` tokens, or a decode step."""

    what: str
    kind: str  # "prefill" | "decode"
    tokens: int
    published_s: float
    url: str
    batch: int = 1
    """Prefill: sequences of ``tokens`` each, in one batch (attention within each)."""


@dataclass(frozen=True)
class Hardware:
    name: str
    gpu: GPU
    tp: int
    model: Model
    nvme: Storage
    network: Storage
    mfu: float
    """Prefill model FLOPs utilisation (of the dense BF16 peak)."""
    tp_efficiency: float = 1.0
    """Share of TP x one GPU's speed a TP group reaches (all-reduces between layers)."""
    decode_efficiency: float = 0.7
    """Share of HBM bandwidth a batch-1 decode step reaches."""
    launch_overhead_s: float = 0.004
    checks: tuple[Check, ...] = ()
    notes: tuple[str, ...] = ()

    # ------------------------------------------------------------------ costs
    @property
    def flops(self) -> float:
        return self.gpu.bf16_tflops * 1e12 * self.tp * self.tp_efficiency * self.mfu

    def prefill(self) -> PrefillCost:
        weights_pass = 2 * self.model.params / (self.gpu.hbm_GBps * GB * self.tp)
        return PrefillCost(
            overhead_s=self.launch_overhead_s + weights_pass,
            per_token_s=2 * self.model.params / self.flops,
            per_token_ctx_s=self.model.attn_flops_per_pair / self.flops,
        )

    def decode_step_s(self, context_tokens: int) -> float:
        nbytes = 2 * self.model.params + context_tokens * self.model.kv_bytes_per_token
        bw = self.gpu.hbm_GBps * GB * self.tp * self.tp_efficiency * self.decode_efficiency
        return self.launch_overhead_s / 2 + nbytes / bw

    def cost_model(self) -> CostModel:
        g, n, r = self.gpu, self.nvme, self.network
        pcie_r, pcie_w = g.pcie_h2d_GBps * GB * self.tp, g.pcie_d2h_GBps * GB * self.tp
        return CostModel(
            model=f"modelled:{self.model.name}",
            machine=f"modelled:{self.name}",
            kv_bytes_per_token=self.model.kv_bytes_per_token,
            num_layers=self.model.layers,
            prefill=self.prefill(),
            tiers={
                # PCIe and Ethernet carry both directions at once (a GPU has a copy engine
                # each way); a drive's reads and writes share its flash.
                "cpu": TierCost("cpu", LinearCost(10e-6, pcie_r), LinearCost(10e-6, pcie_w),
                                duplex=True),
                # A disk read lands in pinned memory, then crosses PCIe: the slower of the two.
                "disk": TierCost("disk",
                                 LinearCost(n.read_latency_s, min(n.read_GBps * GB, pcie_r)),
                                 LinearCost(n.write_latency_s, min(n.write_GBps * GB, pcie_w))),
                "redis": TierCost("redis",
                                  LinearCost(r.read_latency_s, min(r.read_GBps * GB, pcie_r)),
                                  LinearCost(r.write_latency_s, min(r.write_GBps * GB, pcie_w)),
                                  duplex=True),
            },
            stream_min_tokens=0,  # on CUDA a restore always streams layer by layer
        )

    def predicted(self, check: Check) -> float:
        if check.kind == "decode":
            return self.decode_step_s(check.tokens)
        p, n, b = self.prefill(), check.tokens, check.batch
        return p.overhead_s + p.per_token_s * n * b + p.per_token_ctx_s * b * n * (n / 2)

    def document(self) -> dict[str, Any]:
        """The profile file: the cost model, what it was built from, and its checks."""
        cost = self.cost_model()
        urls = {**SOURCES}
        used = [*self.gpu.sources, self.model.source, self.nvme.source, self.network.source]
        return {
            "kvtier_profile": 1,
            "modelled": True,
            "cost_model": cost.to_dict(),
            "hardware": {
                "gpu": self.gpu.name, "gpus": self.tp, "model": self.model.name,
                "bf16_dense_tflops_per_gpu": self.gpu.bf16_tflops, "mfu": self.mfu,
                "tp_efficiency": self.tp_efficiency, "hbm_GBps_per_gpu": self.gpu.hbm_GBps,
                "pcie_h2d_GBps_per_gpu": self.gpu.pcie_h2d_GBps,
                "pcie_d2h_GBps_per_gpu": self.gpu.pcie_d2h_GBps,
                "nvme": self.nvme.name, "network": self.network.name,
                "kv_bytes_per_token": self.model.kv_bytes_per_token,
                "decode_step_s_at_2k_context": self.decode_step_s(2048),
            },
            "how": __doc__.split("\n\n")[1:3],
            "sources": [{"what": k, **urls[k]} for k in dict.fromkeys(used)],
            "checks": [
                {"what": c.what, "published_s": c.published_s,
                 "predicted_s": round(self.predicted(c), 4),
                 "ratio": round(self.predicted(c) / c.published_s, 3), "url": c.url}
                for c in self.checks
            ],
            "notes": list(self.notes),
        }


# ------------------------------------------------------------------------- sources
SOURCES: dict[str, dict[str, str]] = {
    "h100-datasheet": {
        "value": "H100 SXM5: 989 TFLOPS dense BF16 (1,979 with sparsity), 80 GB HBM3 at 3.35 TB/s, PCIe Gen5 x16",
        "url": "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"},
    "a100-datasheet": {
        "value": "A100 SXM4 80GB: 312 TFLOPS dense BF16, HBM2e at 2,039 GB/s, PCIe Gen4 x16",
        "url": "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"},
    "l4-datasheet": {
        "value": "L4: 121 TFLOPS dense BF16 (242 with sparsity), 24 GB GDDR6 at 300 GB/s, PCIe Gen4 x16",
        "url": "https://www.nvidia.com/en-us/data-center/l4/"},
    "pcie5-copy": {
        "value": "8 x H100 SXM node, measured: host-to-device 54.8 GB/s (87 % of PCIe Gen5 x16), device-to-host 46.8 GB/s",
        "url": "https://github.com/aigatech/vpbenchmarking"},
    "pcie4-copy": {
        "value": "A100-SXM4 (PCIe Gen4 x16), nvbandwidth copy-engine copies: about 25-26 GB/s each way, one direction at a time",
        "url": "https://github.com/NVIDIA/nvbandwidth/issues/11"},
    "llama-3-8b-config": {
        "value": "Llama-3-8B: 8.03 B parameters, 32 layers, 32 query heads, 8 KV heads, head_dim 128",
        "url": "https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json"},
    "llama-3-70b-config": {
        "value": "Llama-3-70B: 70.6 B parameters, 80 layers, 64 query heads, 8 KV heads, head_dim 128",
        "url": "https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json"},
    "nvme-gen4": {
        "value": "Samsung PM9A3 (PCIe Gen4): 6.5 GB/s sequential read, 3.5 GB/s sequential write (vendor specification)",
        "url": "https://www.computerbase.de/2020-05/samsung-pm9a3-e1.s-pcie-4.0-ssd/"},
    "nvme-gen5": {
        "value": "Samsung PM1743 (PCIe Gen5): 13 GB/s sequential read, 6.6 GB/s write (vendor specification); "
                 "Micron 9550 (Gen5): typical latency 60 us read, 15 us write",
        "url": "https://computerbase.de/2021-12/samsung-pm1743-pcie-5.0-ssd-mit-13-gb-s-und-2.5-mio.-iops-fuer-server"},
    "net-25gbe": {
        "value": "25 GbE: 3.125 GB/s line rate, modelled at 80 % for MB-sized values over TCP (no published "
                 "measurement of Redis over 25 GbE was found; on localhost LMCache measured redis-benchmark "
                 "32 MiB SET 4.67 GB/s, GET 1.48 GB/s, and redis-py 0.45-0.65 GB/s)",
        "url": "https://github.com/LMCache/lmcache_redis"},
    "net-100gbe": {
        "value": "100 GbE: 12.5 GB/s line rate, modelled at 80 % (an RDMA transfer engine: Mooncake moved "
                 "40 GB at 87 GB/s over 4 x 200 Gbps RoCE, near line rate)",
        "url": "https://github.com/kvcache-ai/Mooncake"},
    "argonne-bench": {
        "value": "LLM-Inference-Bench (Argonne): Llama-3-8B, 1024 input tokens x batch 16, vLLM: TTFT 0.426 s "
                 "(1 x H100), 1.042 s (1 x A100); input = output = 1024 at batch 1: 8.10 s (H100), 14.94 s "
                 "(A100), 19.61 s (70B, 4 x H100) end to end",
        "url": "https://github.com/argonne-lcf/LLM-Inference-Bench"},
    "trtllm-v0.5": {
        "value": "TensorRT-LLM v0.5 performance: batch 1, Llama-2-70B TP4, first token after 2,048 tokens: "
                 "377 ms (A100, FP16), 109 ms (H100, FP8)",
        "url": "https://github.com/NVIDIA/TensorRT-LLM/blob/138f96d45f90b9667426f7c47297d8c06bafac73/docs/source/performance.md"},
}

H100 = GPU("H100-SXM", 989.0, 3350.0, 80.0, 54.8, 46.8, ("h100-datasheet", "pcie5-copy"))
A100 = GPU("A100-SXM-80GB", 312.0, 2039.0, 80.0, 25.0, 25.0, ("a100-datasheet", "pcie4-copy"))
L4 = GPU("L4", 121.0, 300.0, 24.0, 25.0, 25.0, ("l4-datasheet", "pcie4-copy"))

LLAMA3_8B = Model("Llama-3-8B", 8.03e9, 32, 32, 8, 128, "llama-3-8b-config")
LLAMA3_70B = Model("Llama-3-70B", 70.6e9, 80, 64, 8, 128, "llama-3-70b-config")

NVME_GEN4 = Storage("NVMe Gen4 (PM9A3-class)", 6.5, 3.5, 90e-6, 30e-6, "nvme-gen4")
NVME_GEN5 = Storage("NVMe Gen5 (PM1743-class)", 13.0, 6.6, 60e-6, 15e-6, "nvme-gen5")
NET_25GBE = Storage("remote store over 25 GbE", 2.5, 2.5, 300e-6, 300e-6, "net-25gbe")
NET_100GBE = Storage("remote store over 100 GbE", 10.0, 10.0, 150e-6, 150e-6, "net-100gbe")
NETWORKS = {"25gbe": NET_25GBE, "100gbe": NET_100GBE}


@dataclass
class _Catalog:
    profiles: dict[str, Hardware] = field(default_factory=dict)

    def add(self, hw: Hardware) -> None:
        self.profiles[hw.name] = hw


CATALOG = _Catalog()
_ARGONNE = SOURCES["argonne-bench"]["url"]
_TRT = SOURCES["trtllm-v0.5"]["url"]
_MFU = {"H100-SXM": 0.6, "A100-SXM-80GB": 0.7}
"""Prefill MFU, set from the Argonne batch-16 prefill runs (about 62 % on H100 and 81 % on
A100 with attention ignored): a batch of 16K tokens keeps the tensor cores busy."""
_CHECKS = {
    "h100-llama-3-8b": (
        Check("Llama-3-8B prefill, 16 x 1,024 tokens, vLLM, 1 x H100", "prefill", 1024, 0.426,
              _ARGONNE, batch=16),
        Check("Llama-3-8B decode step (upper bound: 1,024 in + 1,024 out at batch 1 / 1,024)",
              "decode", 1536, 8.10 / 1024, _ARGONNE)),
    "a100-llama-3-8b": (
        Check("Llama-3-8B prefill, 16 x 1,024 tokens, vLLM, 1 x A100", "prefill", 1024, 1.042,
              _ARGONNE, batch=16),
        Check("Llama-3-8B decode step (upper bound, as above)", "decode", 1536, 14.94 / 1024,
              _ARGONNE)),
    "a100-llama-3-70b-tp4": (
        Check("Llama-2-70B first token after 2,048 tokens, TRT-LLM FP16, 4 x A100", "prefill",
              2048, 0.377, _TRT),),
    "h100-llama-3-70b-tp4": (
        Check("Llama-2-70B first token after 2,048 tokens, TRT-LLM FP8 (BF16 is slower), 4 x H100",
              "prefill", 2048, 0.109, _TRT),
        Check("Llama-3-70B decode step (upper bound: 1,024 in + 1,024 out at batch 1 / 1,024)",
              "decode", 1536, 19.61 / 1024, _ARGONNE)),
}
for _gpu, _nvme, _net in ((H100, NVME_GEN5, NET_100GBE), (A100, NVME_GEN4, NET_25GBE)):
    _tag = _gpu.name.split("-")[0].lower()
    _name = f"{_tag}-llama-3-8b"
    CATALOG.add(Hardware(_name, _gpu, 1, LLAMA3_8B, _nvme, _net, mfu=_MFU[_gpu.name],
                         checks=_CHECKS.get(_name, ())))
    for _tp, _eff in ((4, 0.85), (8, 0.75)):
        _name = f"{_tag}-llama-3-70b-tp{_tp}"
        CATALOG.add(Hardware(_name, _gpu, _tp, LLAMA3_70B, _nvme, _net, mfu=_MFU[_gpu.name],
                             tp_efficiency=_eff, checks=_CHECKS.get(_name, ()),
                             notes=() if _tp == 4 else ("No published TP8 measurement was found; "
                                                        "the TP efficiency is assumed.",)))
CATALOG.add(Hardware("l4-llama-3-8b", L4, 1, LLAMA3_8B, NVME_GEN4, NET_25GBE, mfu=0.45,
                     notes=("Llama-3-8B in BF16 (16 GB) leaves about 6 GB of an L4's 24 GB "
                            "for KV: about 48k tokens.",
                            "No published L4 prefill or decode measurement was found; the MFU "
                            "is assumed, lower than the H100's.")))


def with_network(cost: CostModel, network: str) -> CostModel:
    """``cost`` with its redis tier replaced by a remote store over ``network`` (capped by
    PCIe as the profiles' own are: the bytes land in host memory first)."""
    from dataclasses import replace

    net = NETWORKS[network]
    cpu = cost.tiers.get("cpu")
    cap_r = cpu.read.bandwidth_bps if cpu else float("inf")
    cap_w = cpu.write.bandwidth_bps if cpu else float("inf")
    redis = TierCost("redis", LinearCost(net.read_latency_s, min(net.read_GBps * GB, cap_r)),
                     LinearCost(net.write_latency_s, min(net.write_GBps * GB, cap_w)), duplex=True)
    return replace(cost, tiers={**cost.tiers, "redis": redis})


def profile_names() -> list[str]:
    return sorted(CATALOG.profiles)


def hardware(name: str) -> Hardware:
    try:
        return CATALOG.profiles[name]
    except KeyError:
        raise InvalidArgumentError(
            f"no hardware profile {name!r}; shipped: {', '.join(profile_names())}") from None


def write_profiles(directory: str | os.PathLike[str]) -> list[Path]:
    """Every catalogued profile as ``<name>.json`` in ``directory`` (atomic writes)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, hw in sorted(CATALOG.profiles.items()):
        path = out / f"{name}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(hw.document(), indent=2) + "\n")
        os.replace(tmp, path)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------- command
def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "hardware-profiles",
        help="write the shipped GPU hardware profiles (modelled, with sources and checks)",
        description="Write every hardware profile (H100/A100 with Llama-3-8B and -70B, L4 with "
        "an 8B model) as JSON, with the sources of every constant and each profile's "
        "predictions next to published measurements; print the checks.",
    )
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parents[1] / "profiles")
    p.set_defaults(func=_run)


def _run(args: Any) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console() if Console().is_terminal else Console(width=160)
    paths = write_profiles(args.out_dir)
    t = Table(title="hardware profiles: prediction vs published", title_justify="left")
    for col in ("profile", "prefill 8k tokens", "check", "published", "predicted", "ratio"):
        t.add_column(col)
    for name in profile_names():
        hw = hardware(name)
        doc = hw.document()
        rows = doc["checks"] or [{"what": "(no published number found)", "published_s": None,
                                  "predicted_s": None, "ratio": None}]
        for c in rows:
            t.add_row(name, f"{hw.prefill().time(0, 8192):.3f} s", c["what"],
                      "" if c["published_s"] is None else f"{c['published_s']:.3f} s",
                      "" if c["predicted_s"] is None else f"{c['predicted_s']:.3f} s",
                      "" if c["ratio"] is None else f"{c['ratio']:.2f}")
    console.print(t)
    for p in paths:
        console.print(f"wrote {p}")
    return 0
