"""The Triton kernels lower to cubin for real GPUs, checked without one: the interpreter
tests prove what the kernels compute, this proves Triton can compile them (sm_80, sm_90)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize(("arch", "dtype", "head_dim"),
                         [(90, "bfloat16", 128), (80, "float16", 64), (90, "float32", 128)])
def test_kernels_compile_for_cuda_targets(arch, dtype, head_dim):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = env.get("TRITON_DEFAULT_FP_FUSION", "1")
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.gpu_pool.kernels.aot", "--arch", str(arch),
         "--dtype", dtype, "--head-dim", str(head_dim)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    compiled = [ln for ln in out.stdout.splitlines() if " ok " in ln]
    kernels = {ln.split(" ok ")[0].split(maxsplit=3)[-1].strip() for ln in compiled}
    assert kernels == {"decode split=False", "decode split=True", "decode reduce", "prefill",
                       "blocks to_pool=False", "blocks to_pool=True", "kv write"}
