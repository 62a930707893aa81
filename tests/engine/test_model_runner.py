"""ModelRunner on the paged pool: chunked prefill, prefix-cache hits, mixed prefill/decode
batches, pool sizing and argument errors."""

import pytest
import torch

from kvtier.engine.model_runner import ModelRunner
from kvtier.errors import InvalidArgumentError, UnknownSequenceError
from kvtier.models.checkpoint import load_checkpoint

torch.set_num_threads(2)
ATOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama3")[1]


def runner_for(ckpt, **kw) -> ModelRunner:
    kw.setdefault("num_blocks", 64)
    return ModelRunner(ckpt, dtype="float32", device="cpu", block_size=8, **kw)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 384, (n,), generator=g).tolist()


def one_shot(ckpt, toks: list[int]) -> torch.Tensor:
    r = runner_for(ckpt, enable_prefix_caching=False)
    r.add_sequence("s", toks)
    return r.run([("s", len(toks))], all_positions=True)


def test_chunked_prefill_equals_one_shot(ckpt):
    toks = tokens(29, seed=1)
    ref = one_shot(ckpt, toks)
    r = runner_for(ckpt)
    r.add_sequence("s", toks)
    parts = []
    for n in (5, 7, 5, 7, 5):
        parts.append(r.run([("s", n)], all_positions=True))
        assert r.pool.sequence("s").num_computed_tokens == sum(p.shape[0] for p in parts)
    torch.testing.assert_close(torch.cat(parts), ref, atol=ATOL, rtol=0)


def test_prefix_cache_hit_gives_same_logits(ckpt):
    shared = tokens(24, seed=2)  # three full blocks of 8
    a, b = shared + tokens(5, seed=3), shared + tokens(6, seed=4)
    r = runner_for(ckpt)
    r.add_sequence("a", a)
    r.run([("a", len(a))])
    res = r.add_sequence("b", b)
    assert res.num_cached_tokens == 24 and r.pool.sequence("b").num_computed_tokens == 24
    hit = r.run([("b", len(b) - 24)], all_positions=True)
    torch.testing.assert_close(hit, one_shot(ckpt, b)[24:], atol=ATOL, rtol=0)


def test_full_prefix_hit_feeds_last_token_without_rewriting(ckpt):
    toks = tokens(16, seed=5)
    r = runner_for(ckpt)
    r.add_sequence("a", toks)
    first = r.run([("a", 16)])
    before = r.pool.storage.kv.clone()
    assert r.add_sequence("b", toks).num_cached_tokens == 16
    again = r.run([("b", 1)])
    torch.testing.assert_close(again, first, atol=ATOL, rtol=0)
    assert torch.equal(r.pool.storage.kv, before)  # the shared blocks were not written


def test_mixed_prefill_and_decode_batch_equals_each_alone(ckpt):
    p, q, s = tokens(13, seed=6), tokens(20, seed=7), tokens(9, seed=8)
    r = runner_for(ckpt)
    r.add_sequence("p", p)
    r.run([("p", 13)])
    r.append_tokens("p", [5])
    r.add_sequence("q", q)
    r.run([("q", 6)])
    r.add_sequence("s", s)
    # p decodes one token, q continues its prefill with 7, s prefills all of its prompt
    mixed = r.run([("p", 1), ("q", 7), ("s", 9)])
    assert mixed.shape == (3, 384)
    torch.testing.assert_close(mixed[0], one_shot(ckpt, p + [5])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed[1], one_shot(ckpt, q[:13])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed[2], one_shot(ckpt, s)[-1], atol=ATOL, rtol=0)
    # a pure decode batch (decode kernel) continues all three
    for sid in ("p", "q", "s"):
        seq = r.pool.sequence(sid)
        if seq.num_computed_tokens == seq.num_tokens:
            r.append_tokens(sid, [7])
    r.run([("q", 7)])
    r.append_tokens("q", [7])
    dec = r.run([("p", 1), ("q", 1), ("s", 1)])
    torch.testing.assert_close(dec[0], one_shot(ckpt, p + [5, 7])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(dec[1], one_shot(ckpt, q + [7])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(dec[2], one_shot(ckpt, s + [7])[-1], atol=ATOL, rtol=0)


def test_config_and_state_dict_constructor_and_memory_sizing(ckpt):
    cfg, state = load_checkpoint(ckpt)
    per_block = 2 * cfg.num_hidden_layers * 8 * cfg.num_key_value_heads * cfg.head_dim * 4
    r = ModelRunner(config=cfg, state_dict=state, device="cpu", block_size=8,
                    memory_bytes=10 * per_block + 5, max_model_len=64)
    assert r.pool.storage.num_blocks == 10 and r.max_model_len == 64
    assert r.pool.storage.kv.shape == (2, 10, 2, 8, 2, 16)
    # The fingerprint names the weights: one changed weight, another fingerprint.
    assert r.fingerprint == cfg.fingerprint("float32", r.weights_digest)
    bumped = dict(state, **{"model.norm.weight": state["model.norm.weight"] + 1e-3})
    other = ModelRunner(config=cfg, state_dict=bumped, device="cpu", num_blocks=4, block_size=8)
    assert other.fingerprint != r.fingerprint
    toks = tokens(10, seed=9)
    assert r.generate_greedy(toks, 5) == runner_for(ckpt).generate_greedy(toks, 5)
    assert "__generate_greedy__" not in r.pool


def test_errors(ckpt):
    r = runner_for(ckpt, max_model_len=32)
    with pytest.raises(InvalidArgumentError, match="over max_model_len 32"):
        r.add_sequence("long", tokens(33, seed=1))
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        r.add_sequence("v", [1, 2, 384])
    r.add_sequence("a", tokens(10, seed=1))
    with pytest.raises(InvalidArgumentError, match="cannot feed 11 tokens, 10 are uncomputed"):
        r.run([("a", 11)])
    with pytest.raises(InvalidArgumentError, match="cannot feed 0"):
        r.run([("a", 0)])
    with pytest.raises(InvalidArgumentError, match="twice"):
        r.run([("a", 1), ("a", 1)])
    with pytest.raises(UnknownSequenceError):
        r.run([("zzz", 1)])
    r.run([("a", 10)])
    with pytest.raises(InvalidArgumentError, match="cannot feed 2 tokens, 0 are uncomputed"):
        r.run([("a", 2)])
    with pytest.raises(InvalidArgumentError, match="over max_model_len"):
        r.append_tokens("a", tokens(23, seed=2))
    with pytest.raises(InvalidArgumentError, match="max_model_len=600"):
        runner_for(ckpt, max_model_len=600)
    with pytest.raises(InvalidArgumentError, match="num_blocks or memory_bytes"):
        ModelRunner(ckpt, device="cpu")
    with pytest.raises(InvalidArgumentError, match="model_dir or config"):
        ModelRunner(device="cpu", num_blocks=4)
