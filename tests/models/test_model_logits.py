"""The engine against Hugging Face transformers on random-weight checkpoints of every
supported architecture: prefill logits at every position, step-by-step decode through the
paged pool, and greedy generations.

Tolerances: fp32 1e-4 absolute on logits (only summation order differs: the paged
attention is fp32 math over gathered blocks, HF uses SDPA); bf16/fp16 engines against the
fp32 oracle: 5e-2 / 1e-2 absolute on logits of magnitude ~1-3 (weights and activations are
rounded to 8 / 11 mantissa bits).
"""

import pytest
import torch

from kvtier.engine.model_runner import ModelRunner

torch.set_num_threads(2)

VARIANTS = [
    ("llama3", {}),  # llama3 rope scaling, untied
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"attention_bias": True, "mlp_bias": True,
               "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    ("qwen2", {"max_shard_size": "100KB"}),  # qkv bias, sharded checkpoint
    ("mistral", {}),
]
IDS = ["llama3-rope", "llama-tied", "llama-bias-linear-rope", "qwen2-sharded", "mistral"]
ATOL = 1e-4


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def prompt(n: int, seed: int, vocab: int = 384) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module", params=list(zip(IDS, VARIANTS, strict=True)), ids=IDS)
def pair(request, tiny_checkpoint):
    _, (arch, overrides) = request.param
    model, d = tiny_checkpoint(arch, **overrides)
    runner = ModelRunner(d, dtype="float32", device="cpu", num_blocks=64, block_size=8)
    return model, runner


def test_prefill_logits_every_position(pair):
    model, runner = pair
    tokens = prompt(45, seed=1)
    runner.add_sequence("p", tokens)
    try:
        ours = runner.run([("p", len(tokens))], all_positions=True)
    finally:
        runner.free_sequence("p")
    ref = hf_logits(model, tokens)
    assert ours.shape == ref.shape
    assert ref.abs().max() > 0.5  # the weights are large enough for the check to mean much
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def test_decode_step_by_step_through_the_pool(pair):
    model, runner = pair
    tokens = prompt(11, seed=2)
    runner.add_sequence("d", tokens)
    ours = [runner.run([("d", len(tokens))])[0]]
    try:
        for _ in range(12):  # crosses block boundaries (block_size 8)
            tokens.append(int(ours[-1].argmax()))
            runner.append_tokens("d", tokens[-1:])
            ours.append(runner.run([("d", 1)])[0])
    finally:
        runner.free_sequence("d")
    ref = hf_logits(model, tokens)[10:]
    torch.testing.assert_close(torch.stack(ours), ref, atol=ATOL, rtol=0)


def test_greedy_generation_matches_hf_generate(pair):
    model, runner = pair
    tokens = prompt(9, seed=3)
    with torch.no_grad():
        ids = torch.tensor([tokens])  # explicit mask: a prompt token may equal the pad id
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                            do_sample=False, eos_token_id=None)[0, len(tokens):].tolist()
    assert runner.generate_greedy(tokens, 16) == hf
    assert len(set(hf)) > 2  # not a degenerate repeat of one token


@pytest.mark.parametrize(("dtype", "atol"), [("bfloat16", 5e-2), ("float16", 1e-2)])
def test_half_precision_close_to_fp32_oracle(tiny_checkpoint, dtype, atol):
    model, d = tiny_checkpoint("llama3")
    runner = ModelRunner(d, dtype=dtype, device="cpu", num_blocks=16, block_size=8)
    assert runner.pool.storage.kv.dtype == getattr(torch, dtype)
    tokens = prompt(20, seed=4)
    runner.add_sequence("h", tokens[:15])
    pre = runner.run([("h", 15)], all_positions=True)
    runner.append_tokens("h", tokens[15:16])
    dec = runner.run([("h", 1)])
    ref = hf_logits(model, tokens[:16])
    torch.testing.assert_close(torch.cat([pre, dec]), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2", "tiny-mistral"])
def test_make_model_checkpoints_match_transformers(preset, tmp_path):
    """The checkpoints `kvtier make-model` writes: the engine and transformers agree on them."""
    from transformers import AutoModelForCausalLM

    from kvtier.make_model.writer import make_model

    made = make_model(preset, tmp_path / preset, dtype="float32", seed=11)
    hf = AutoModelForCausalLM.from_pretrained(made.path, dtype=torch.float32).eval()
    runner = ModelRunner(made.path, dtype="float32", device="cpu", num_blocks=64)
    tokens = prompt(40, seed=2, vocab=made.tokenizer_vocab_size)
    runner.add_sequence("m", tokens)
    ours = runner.run([("m", len(tokens))], all_positions=True)
    ref = hf_logits(hf, tokens)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    # Greedy decode through the pool equals transformers' greedy generate.
    runner.free_sequence("m")
    out = runner.generate_greedy(tokens, 10)
    with torch.no_grad():
        ids = torch.tensor([tokens])  # explicit mask: a prompt token may equal the pad id
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                          do_sample=False, min_new_tokens=10, pad_token_id=0)
    assert out == gen[0, len(tokens):].tolist()
