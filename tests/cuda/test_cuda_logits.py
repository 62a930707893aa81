"""The engine on the device against Hugging Face transformers on the same device: prefill
logits at every position, step-by-step decode through the paged pool (the Triton decode
kernel on CUDA), and a bf16 engine against the fp32 oracle.

Tolerances as in tests/models/test_model_logits.py, widened for fp32 on a GPU where cuBLAS
and transformers' SDPA kernels sum in other orders than the CPU: 5e-4 absolute on logits of
magnitude ~1-3; bf16 against the fp32 oracle 5e-2.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvtier.engine.model_runner import ModelRunner

ATOL = {"float32": 5e-4, "bfloat16": 5e-2}


def _prompt(n: int, seed: int, vocab: int = 384) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def pair(tiny_checkpoint, device):
    model, d = tiny_checkpoint("llama3")
    return copy.deepcopy(model).to(device), d  # the session's cached model stays on the CPU


def _hf_logits(model, tokens: list[int], device) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens], device=device)).logits[0].float()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_and_decode_logits_match_transformers(device, pair, dtype):
    model, d = pair
    runner = ModelRunner(d, dtype=dtype, device=device, num_blocks=64, block_size=16)
    assert runner.pool.storage.kv.device.type == device.type
    tokens = _prompt(45, seed=1)
    runner.add_sequence("p", tokens)
    pre = runner.run([("p", len(tokens))], all_positions=True)
    steps = []
    for _ in range(20):  # crosses a block boundary (45 -> 65 tokens)
        tokens.append(int((steps[-1] if steps else pre[-1]).argmax()))
        runner.append_tokens("p", tokens[-1:])
        steps.append(runner.run([("p", 1)])[0])
    runner.free_sequence("p")
    ref = _hf_logits(model, tokens, device)
    assert ref.abs().max() > 0.5
    ours = torch.cat([pre, torch.stack(steps)]).float()
    assert ours.device.type == device.type
    torch.testing.assert_close(ours, ref[: ours.shape[0]], atol=ATOL[dtype], rtol=0)


def test_greedy_generation_matches_transformers(device, pair):
    model, d = pair
    runner = ModelRunner(d, dtype="float32", device=device, num_blocks=32, block_size=16)
    tokens = _prompt(9, seed=3)
    with torch.no_grad():
        ids = torch.tensor([tokens], device=device)
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                            do_sample=False, eos_token_id=None)[0, len(tokens):].tolist()
    assert runner.generate_greedy(tokens, 16) == hf
    assert len(set(hf)) > 2
