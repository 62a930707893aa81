"""The model fingerprint names the weights: two checkpoints with one config.json in folders
of the same name never share KV (the cross-restore the old fingerprint allowed), a changed
weight file gets a new fingerprint, and the digest is recomputed only for changed files."""

from __future__ import annotations

import json
import os

import torch

from kvtier.config import TiersConfig
from kvtier.engine.engine import Engine
from kvtier.engine.model_runner import ModelRunner
from kvtier.engine.sampling import SamplingParams
from kvtier.make_model.writer import make_model
from kvtier.models.weights_digest import RECORD_FILE
from tests.engine_config import engine_config

GREEDY = SamplingParams(max_tokens=8)
SYSTEM = "You are the storage team's assistant; you answer about KV caches and tiers. " * 8


def _runner(path) -> ModelRunner:
    return ModelRunner(path, dtype="float32", device="cpu", num_blocks=8, block_size=16)


def test_same_config_same_folder_name_other_seed_is_another_model(tmp_path):
    a = make_model("tiny", tmp_path / "a" / "tiny", seed=0).path
    b = make_model("tiny", tmp_path / "b" / "tiny", seed=1).path
    assert (a / "config.json").read_text() == (b / "config.json").read_text()
    assert _runner(a).fingerprint != _runner(b).fingerprint
    # The same weights in a folder of another name are the same model.
    c = make_model("tiny", tmp_path / "c" / "other-name", seed=0).path
    assert _runner(c).fingerprint == _runner(a).fingerprint


def test_engine_b_never_restores_engine_a_kv_through_a_shared_disk(tmp_path):
    torch.set_num_threads(1)
    a = make_model("tiny", tmp_path / "a" / "tiny", seed=0).path
    b = make_model("tiny", tmp_path / "b" / "tiny", seed=1).path
    tiers = TiersConfig(cpu_bytes=0, disk_dir=str(tmp_path / "chunks"), disk_bytes=64 << 20,
                        disk_fsync=False)
    plain = Engine(b, engine_config(num_blocks=128, tiers=None, chunk_tokens=64))
    expected = plain.chat("s", "What is a KV cache?", GREEDY, system=SYSTEM)
    plain.close()
    writer = Engine(a, engine_config(num_blocks=128, tiers=tiers, chunk_tokens=64))
    try:
        writer.chat("s", "What is a KV cache?", GREEDY, system=SYSTEM)
        assert writer.offload("s", "disk").stored_tokens >= 128
    finally:
        writer.close()
    reader = Engine(b, engine_config(num_blocks=128, tiers=tiers, chunk_tokens=64))
    try:
        turn = reader.chat("s", "What is a KV cache?", GREEDY, system=SYSTEM)
    finally:
        reader.close()
    assert turn.stats.restored_tokens == 0  # A's KV is not B's: recomputed
    assert turn.token_ids == expected.token_ids  # B's own reply


def test_a_changed_weight_file_changes_the_fingerprint_and_only_it_is_rehashed(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_model("tiny", tmp_path / "tiny", seed=0).path
    before = _runner(path).fingerprint
    record = json.loads((path / RECORD_FILE).read_text())["files"]
    assert set(record) == {"model.safetensors"}
    weights = load_file(str(path / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.5
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    after = _runner(path).fingerprint
    assert after != before
    # An unchanged file is not read again: a forged record entry with the file's own size
    # and mtime is trusted, which shows the recorded hash is what was used.
    st = os.stat(path / "model.safetensors")
    doc = {"files": {"model.safetensors": {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                           "sha256": "0" * 64}}}
    (path / RECORD_FILE).write_text(json.dumps(doc))
    assert _runner(path).fingerprint not in (before, after)


def test_a_record_that_cannot_be_written_costs_only_rehashing(tmp_path, caplog):
    path = make_model("tiny", tmp_path / "tiny", seed=0).path
    (path / RECORD_FILE).mkdir()  # something in the way: the record cannot be replaced
    first = _runner(path).fingerprint
    assert "cannot record weight digests" in caplog.text
    assert _runner(path).fingerprint == first  # hashed again, the same


def test_a_salt_separates_engines_of_the_same_model(tmp_path):
    torch.set_num_threads(1)
    path = make_model("tiny", tmp_path / "tiny", seed=0).path
    tiers = TiersConfig(cpu_bytes=0, disk_dir=str(tmp_path / "chunks"), disk_bytes=64 << 20,
                        disk_fsync=False)

    def engine(salt):
        return Engine(path, engine_config(num_blocks=128, tiers=tiers, chunk_tokens=64,
                                          fingerprint_salt=salt))

    writer = engine("tenant-a")
    try:
        writer.chat("s", "What is a KV cache?", GREEDY, system=SYSTEM)
        writer.offload("s", "disk")
    finally:
        writer.close()
    for salt, shares in (("tenant-b", False), (None, False), ("tenant-a", True)):
        reader = engine(salt)
        try:
            turn = reader.chat("s", "What is a KV cache?", GREEDY, system=SYSTEM)
        finally:
            reader.close()
        assert (turn.stats.restored_tokens > 0) is shares, salt
