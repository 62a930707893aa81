"""The torch-SDPA recompute reference computes what the engine's prefill computes (same
last-token logits, same greedy token), and `kvtier bench ttft` times it on every row."""

from __future__ import annotations

import json

import pytest
import torch

from kvtier.benchmarks.sdpa_prefill import SDPAPrefill
from kvtier.cli.main import main
from kvtier.engine.model_runner import ModelRunner
from kvtier.make_model.writer import make_model

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Generated checkpoints by preset: ``tiny`` (GQA 4/2, llama3 rope scaling, untied)
    and ``tiny-qwen2`` (GQA 4/1, q/k/v biases, tied embeddings)."""
    root = tmp_path_factory.mktemp("sdpa-models")
    out = {}
    for preset in ("tiny", "tiny-qwen2"):
        make_model(preset, root / preset, dtype="float32", progress=False)
        out[preset] = root / preset
    return out


def engine_last_logits(model_dir, ids: list[int]) -> tuple[ModelRunner, torch.Tensor]:
    """The engine's prefill of ``ids`` in one step on its paged pool."""
    runner = ModelRunner(model_dir, dtype="float32", device="cpu", num_blocks=64)
    runner.add_sequence("s", ids)
    return runner, runner.run([("s", len(ids))])[0]


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])
def test_reference_logits_and_greedy_token_equal_the_engines(models, preset):
    # Past the tiny preset's original_max_position_embeddings (256): llama3 scaling bites.
    ids = torch.randint(0, 1000, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    runner, engine = engine_last_logits(models[preset], ids)
    ref = SDPAPrefill.load(models[preset], dtype="float32", device="cpu")
    logits = ref.last_logits(ids)
    assert logits.shape == (runner.config.vocab_size,) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, engine, atol=1e-4, rtol=1e-4)
    assert int(logits.argmax()) == int(engine.argmax())
    # The runner's own tensors give the same numbers; so do K/V repeated per query head.
    shared = SDPAPrefill.from_model(runner.model)
    assert shared.w["model.embed_tokens.weight"].data_ptr() == (
        runner.model.model.embed_tokens.weight.data_ptr())
    torch.testing.assert_close(shared.last_logits(ids), logits, atol=1e-5, rtol=1e-5)
    shared.gqa = "repeat_kv"
    torch.testing.assert_close(shared.last_logits(ids), logits, atol=1e-5, rtol=1e-5)
    # Every token counts: another first token gives other logits.
    other = ref.last_logits([(ids[0] + 1) % 1000, *ids[1:]])
    assert not torch.allclose(other, logits, atol=1e-6, rtol=0)


def test_bench_ttft_times_the_sdpa_reference_on_every_row(tmp_path, models):
    out = tmp_path / "ttft.json"
    argv = ["bench", "ttft", "--model", str(models["tiny"]), "--histories", "64,96",
            "--chunk-tokens", "32", "--repeats", "1", "--shared-prefix", "0",
            "--out", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["history_tokens"] for r in rows] == [64, 96]
    for r in rows:
        assert r["sdpa_recompute_s"] > 0 and r["recompute_s"] > 0
        assert r["sdpa_vs_engine"] == r["sdpa_recompute_s"] / r["recompute_s"]
        assert r["sdpa_gqa"] in ("enable_gqa", "repeat_kv")
        assert "sdpa_recompute_vs_recompute" not in r  # a reference, not a case
