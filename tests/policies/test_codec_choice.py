"""``tiers.<tier>_codec: auto`` (issue 33): the policy never picks a codec outside the
quality budget, picks the fastest restore within it, and the cost model charges a lossy
tier's reads its fewer bytes plus the decode; the error bounds the budget is compared
with hold for the codecs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.config import TiersConfig
from kvtier.connectors.tiers.codec_setup import CodecContext, decode_Bps
from kvtier.connectors.tiers.factory import build_tiers
from kvtier.kv_codecs import ERROR_BOUND, Codec, decode, encode
from kvtier.policies.codec_choice import CodecOption, choose_codec
from kvtier.policies.cost_model import CostModel, LinearCost, PrefillCost, TierCodec, TierCost

SHAPE = (4, 2, 256, 2, 64)


def cost(disk_Bps: float, redis_Bps: float = 1e8) -> CostModel:
    return CostModel(
        model="m", machine="test", kv_bytes_per_token=4096, num_layers=4,
        prefill=PrefillCost(overhead_s=0.0, per_token_s=1e-4, per_token_ctx_s=0.0),
        tiers={n: TierCost(n, LinearCost(1e-4, bw), LinearCost(1e-4, bw))
               for n, bw in (("cpu", 2e10), ("disk", disk_Bps), ("redis", redis_Bps))})


options = st.lists(st.builds(
    CodecOption, name=st.text("abcdef", min_size=1, max_size=4),
    bytes_ratio=st.floats(0.1, 1.0), error_bound=st.floats(0.0, 0.5),
    decode_Bps=st.floats(1e7, 1e11)), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(opts=options, budget=st.floats(0.0, 0.3), link=st.one_of(st.none(), st.floats(1e6, 1e11)),
       memory=st.booleans())
def test_auto_never_picks_a_codec_outside_the_quality_budget(opts, budget, link, memory):
    lossless = CodecOption("none", 1.0, 0.0)
    choice = choose_codec([lossless, *opts], budget, link, memory)
    assert choice.error_bound == 0 or choice.error_bound <= budget
    if link is not None:  # and nothing within the budget restores faster
        best = min(o.restore_seconds_per_byte(link) for o in [lossless, *opts]
                   if o.error_bound == 0 or o.error_bound <= budget)
        assert choice.restore_seconds_per_byte(link) == best


def _resolved(tmp_path, budget: float, cost_model: CostModel | None, **codecs) -> dict[str, str]:
    cfg = TiersConfig(cpu_bytes=8 << 20, disk_dir=str(tmp_path / "d"), disk_bytes=64 << 20,
                      disk_fsync=False, **codecs)
    ctx = CodecContext(SHAPE, torch.bfloat16, budget, cost_model)
    manager = build_tiers(cfg, 1 << 20, b"fp", ctx)
    try:
        return {t.name: t.codec.value for t in manager.tiers}
    finally:
        manager.close()


def test_auto_by_link_speed_and_budget(tmp_path):
    slow = cost(disk_Bps=2e8)  # a link far slower than any decode: compress
    assert _resolved(tmp_path, 0.01, slow, cpu_codec="auto", disk_codec="auto") == {
        "cpu": "none", "disk": "int8"}  # the default budget allows int8 only
    assert _resolved(tmp_path, 0.2, slow, disk_codec="auto")["disk"] == "int4"
    assert _resolved(tmp_path, 0.0, slow, disk_codec="auto")["disk"] == "none"
    fast = cost(disk_Bps=1e13)  # faster than decoding: keep it lossless
    assert _resolved(tmp_path, 0.2, fast, disk_codec="auto")["disk"] == "none"
    # no profile: the smallest within the budget below the CPU tier, none in it
    assert _resolved(tmp_path, 0.07, None, cpu_codec="auto", disk_codec="auto") == {
        "cpu": "none", "disk": "int8"}
    assert _resolved(tmp_path, 0.2, slow, disk_codec="fp8")["disk"] == "fp8"  # as configured


def test_the_cost_model_charges_fewer_bytes_plus_the_decode():
    base = cost(disk_Bps=1e9)
    plain = base.load_time("disk", 1000)
    codec = TierCodec("int8", 0.5, 4e9)
    lossy = CostModel(**{**base.__dict__, "codecs": {"disk": codec}})
    kv = 1000 * base.kv_bytes_per_token
    assert lossy.load_time("disk", 1000) == pytest.approx(1e-4 + kv * 0.5 / 1e9 + kv / 4e9)
    assert lossy.load_time("disk", 1000) < plain
    assert "codecs" not in lossy.to_dict()  # never written into a profile


def test_decode_speed_is_measured():
    assert decode_Bps(Codec.NONE, torch.bfloat16) == math.inf
    assert 0 < decode_Bps(Codec.INT8, torch.bfloat16) < math.inf


@pytest.mark.parametrize("codec", [Codec.FP8, Codec.INT8, Codec.INT4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_error_bounds_hold(codec, dtype):
    """Each value within ERROR_BOUND of the largest magnitude of a set containing its group
    (a head's vector for fp8, int8 and int4 values; a channel over all tokens for int4
    keys), on KV with outlier channels and a wide range of scales."""
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(SHAPE, generator=g) * torch.logspace(-3, 2, SHAPE[-1])
    kv[:, 0, :, :, 5] *= 30
    kv = kv.to(dtype)
    back = decode(encode(kv, codec), codec, SHAPE, dtype).float()
    x = kv.float()
    err = (back - x).abs()
    if codec is Codec.INT4:
        k_max = x[:, 0].abs().amax(1, keepdim=True)  # per layer, head and channel
        v_max = x[:, 1].abs().amax(-1, keepdim=True)  # per layer, token and head
        assert torch.all(err[:, 0] <= ERROR_BOUND[codec] * k_max * (1 + 1e-6))
        assert torch.all(err[:, 1] <= ERROR_BOUND[codec] * v_max * (1 + 1e-6))
    else:
        amax = x.abs().amax(-1, keepdim=True)
        assert torch.all(err <= ERROR_BOUND[codec] * amax * (1 + 1e-6))
