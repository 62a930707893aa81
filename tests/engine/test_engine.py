"""The reference engine end to end on a `make-model` checkpoint: continuous batching,
chunked prefill, preemption, multi-turn KV reuse, per-request errors, the chat command."""

from __future__ import annotations

import argparse
import io

import pytest
import torch

from kvtier.cli.chat import register as register_chat
from kvtier.engine.engine import Engine, RequestError
from kvtier.engine.sampling import SamplingParams
from kvtier.make_model.writer import make_model
from tests.engine_config import engine_config

GREEDY = SamplingParams(max_tokens=12)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_model("tiny", tmp_path_factory.mktemp("tiny") / "model", seed=3).path


def _engine(model_dir, **kw) -> Engine:
    opts = dict(num_blocks=256, max_num_batched_tokens=512, max_num_seqs=64, tiers=None)
    opts.update(kw)
    return Engine(model_dir, engine_config(**opts))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            10, 900, (int(torch.randint(1, 90, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]


def _alone(model_dir, prompts, params=GREEDY) -> list[list[int]]:
    out = []
    for p in prompts:
        (req,) = _engine(model_dir).generate([p], params)
        out.append(req.output_ids)
    return out


def test_continuous_batching_matches_each_sequence_alone(model_dir):
    prompts = _prompts(10)
    expected = _alone(model_dir, prompts)
    # Small budget: long prompts are chunked and interleaved with other sequences' decodes;
    # requests arrive at different steps.
    eng = _engine(model_dir, max_num_batched_tokens=24, max_num_seqs=4)
    reqs = []
    for i, p in enumerate(prompts):
        reqs.append(eng.add_request(p, GREEDY))
        for _ in range(i % 3):
            eng.step()
    eng.run_until_done()
    assert [r.output_ids for r in reqs] == expected
    assert all(r.finish_reason == "length" for r in reqs)
    assert eng.scheduler.steps > len(prompts)


def test_preemption_under_a_small_pool_still_matches(model_dir):
    prompts = _prompts(8, seed=1)
    expected = _alone(model_dir, prompts)
    eng = _engine(model_dir, num_blocks=14, max_num_batched_tokens=64)
    reqs = eng.generate(prompts, GREEDY)
    assert eng.scheduler.preemptions > 0, "the pool was meant to run out"
    assert [r.output_ids for r in reqs] == expected
    assert eng.runner.pool.block_pool.num_used == 0  # everything released


def test_seeded_sampling_does_not_depend_on_the_batch(model_dir):
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=42)
    prompts = _prompts(4, seed=2)
    alone = _alone(model_dir, prompts[:1], params)[0]
    together = _engine(model_dir).generate(prompts, params)[0].output_ids
    assert together == alone


def test_second_turn_reuses_the_first_and_equals_a_recompute(model_dir):
    eng = _engine(model_dir)
    t1 = eng.chat(
        "s",
        "Hello there! Tell me about the weather in the mountains today.",
        GREEDY,
        system="You are a helpful assistant.",
    )
    assert t1.stats.reused_tokens == 0 and t1.stats.recomputed_tokens == t1.stats.prompt_tokens
    message = "And tomorrow?"
    t2 = eng.chat("s", message, GREEDY)
    new_tokens = t2.stats.prompt_tokens - len(
        eng.sessions["s"].token_ids[: t1.stats.prompt_tokens + len(t1.token_ids)]
    )
    block = eng.runner.pool.block_size
    # Only the new message (with its template tokens) and the last partial block of turn 1
    # are computed again.
    assert t2.stats.recomputed_tokens <= new_tokens + block
    assert t2.stats.reused_tokens >= t1.stats.prompt_tokens + len(t1.token_ids) - block
    # A from-scratch engine over the same whole conversation generates the same reply.
    session_ids = eng.sessions["s"].token_ids
    prompt2 = session_ids[: len(session_ids) - len(t2.token_ids)]
    (fresh,) = _engine(model_dir).generate([prompt2], GREEDY)
    assert fresh.num_cached_tokens == 0
    assert fresh.output_ids == t2.token_ids


def test_sessions_batched_together_match_sessions_alone(model_dir):
    eng = _engine(model_dir)
    msgs = [("a", "first session here"), ("b", "a different one"), ("c", "and a third")]
    together = eng.chat_many(msgs, GREEDY)
    for (sid, msg), res in zip(msgs, together, strict=True):
        assert _engine(model_dir).chat(sid, msg, GREEDY).token_ids == res.token_ids


def test_a_prompt_over_max_model_len_fails_alone(model_dir):
    eng = _engine(model_dir, max_model_len=64)
    good = _prompts(3, seed=4)
    good = [p[:40] for p in good]
    reqs = eng.generate([good[0], list(range(10, 80)), good[1], [], good[2]], GREEDY)
    assert [r.finish_reason for r in reqs] == ["length", "error", "length", "error", "length"]
    assert "max_model_len is 64" in reqs[1].error and "shorten the prompt" in reqs[1].error
    assert "empty" in reqs[3].error
    assert [reqs[0].output_ids, reqs[2].output_ids] == _alone(model_dir, [good[0], good[1]])
    with pytest.raises(RequestError, match="max_model_len"):
        eng.chat("long", "word " * 200, GREEDY)
    assert "long" not in eng.sessions


def test_generation_stops_at_max_model_len(model_dir):
    eng = _engine(model_dir, max_model_len=32)
    (req,) = eng.generate([list(range(10, 40))], SamplingParams(max_tokens=50))
    assert req.finish_reason == "length" and len(req.all_ids) == 32


def test_stop_tokens_and_strings(model_dir):
    eng = _engine(model_dir)
    (ref,) = eng.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8))
    stop_tok = ref.output_ids[3]
    (req,) = eng.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, stop_token_ids=(stop_tok,)))
    assert req.finish_reason == "stop"
    assert req.output_ids == ref.output_ids[: ref.output_ids.index(stop_tok) + 1]
    text = ref.text
    needle = next(
        text[i : i + 2]
        for i in range(1, len(text) - 1)
        if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2]
    )
    (cut,) = eng.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, stop=(needle,)))
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(needle)]


def test_streamed_text_equals_the_final_text(model_dir):
    eng = _engine(model_dir)
    pieces: list[str] = []
    res = eng.chat("stream", "stream this please", GREEDY, on_text=pieces.append)
    assert "".join(pieces) == res.text
    assert res.stats.ttft_s is not None and res.stats.ttft_s > 0


def test_chat_command_reads_one_message_per_line(model_dir):
    parser = argparse.ArgumentParser()
    register_chat(parser.add_subparsers())
    args = parser.parse_args(["chat", "--model", str(model_dir), "--max-tokens", "6"])
    out = io.StringIO()
    assert args.func(args, stdin=io.StringIO("hello\n\nsecond turn\n"), stdout=out) == 0
    lines = out.getvalue().splitlines()
    timing = [ln for ln in lines if ln.startswith("[turn")]
    assert len(timing) == 2
    assert timing[0].startswith("[turn 1:") and "0 prompt tokens reused" in timing[0]
    assert timing[1].startswith("[turn 2:") and "0 prompt tokens reused" not in timing[1]


def test_only_ids_the_tokenizer_can_decode_are_sampled(tmp_path):
    padded = make_model("tiny", tmp_path / "padded", vocab_size=4096, seed=1)
    assert padded.tokenizer_vocab_size < 4096  # the embedding is padded past the tokenizer
    eng = _engine(padded.path)
    (req,) = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=40, temperature=1.0, seed=0))
    assert max(req.output_ids) < eng.tokenizer.vocab_size
    assert req.text  # every sampled id decodes to text
    # Without the cut most of the probability mass would sit on undecodable ids.
    eng.runner.add_sequence("raw", [5, 6, 7])
    probs = torch.softmax(eng.runner.run([("raw", 3)])[0], dim=-1)
    assert probs[eng.tokenizer.vocab_size :].sum() > 0.5
