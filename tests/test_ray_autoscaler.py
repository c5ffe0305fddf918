"""Autoscaling decisions, without Ray: each pool from its own signal, within its bounds, with a
cool-down. (The controller driving a real pool is in test_ray_cluster.py.)"""

from __future__ import annotations

import pytest

from pdserve.cluster.autoscaler import Autoscaler, PoolSignal, latency_summary, planner_profile
from pdserve.config import AutoscalerConfig

CFG = AutoscalerConfig(
    enabled=True,
    cooldown_s=10,
    ttft_target_s=1.0,
    tpot_target_s=0.05,
    prefill_tokens_per_s=1000,
    kv_high=0.8,
    kv_low=0.3,
)
BOUNDS = {"prefill": (1, 3), "decode": (1, 4)}


def test_decode_grows_when_tpot_is_over_target_and_shrinks_when_idle():
    a = Autoscaler(CFG, BOUNDS)
    up = a.decide("decode", 1, PoolSignal(size=1, tpot_s=0.08, kv_usage=0.5), now=0)
    assert (up.old, up.new) == (1, 2) and "TPOT" in up.reason
    down = a.decide("decode", 2, PoolSignal(size=2), now=20)  # no observations: idle
    assert (down.old, down.new) == (2, 1)


def test_decode_grows_on_kv_usage_alone():
    d = Autoscaler(CFG, BOUNDS).decide(
        "decode", 2, PoolSignal(size=2, kv_usage=0.9, tpot_s=0.01), 0
    )
    assert d.new == 3 and "KV usage" in d.reason


def test_decode_holds_between_low_and_high():
    a = Autoscaler(CFG, BOUNDS)
    assert a.decide("decode", 2, PoolSignal(size=2, kv_usage=0.5, tpot_s=0.04), 0) is None


def test_prefill_grows_on_queued_prompt_tokens_against_ttft_target():
    a = Autoscaler(CFG, BOUNDS)
    # 2,400 queued tokens on one worker at 1,000 tokens/s: 2.4 s of waiting > 1 s target.
    d = a.decide("prefill", 1, PoolSignal(size=1, queued_prompt_tokens=2400), 0)
    assert d.new == 2 and "queued" in d.reason
    # The decode pool has its own signal: prefill pressure does not move it.
    assert a.decide("decode", 2, PoolSignal(size=2, kv_usage=0.5, tpot_s=0.04), 0) is None


def test_cooldown_prevents_flapping_and_bounds_hold():
    a = Autoscaler(CFG, BOUNDS)
    hot = PoolSignal(size=3, tpot_s=1.0)
    assert a.decide("decode", 3, hot, now=0).new == 4
    assert a.decide("decode", 4, hot, now=5) is None  # cooling down
    assert a.decide("decode", 4, hot, now=11) is None  # at max
    assert a.decide("decode", 1, PoolSignal(size=1), now=30) is None  # at min


def test_latency_summary_uses_the_window_only():
    obs = [(0.0, 9.0, 9.0), (95.0, 0.2, 0.02), (99.0, 0.4, None)]
    ttft, tpot = latency_summary(obs, now=100.0, window_s=10.0)
    assert abs(ttft - 0.3) < 1e-9 and abs(tpot - 0.02) < 1e-9
    assert latency_summary(obs, now=200.0, window_s=10.0) == (None, None)


def test_planner_mode_moves_a_pool_to_its_target_within_bounds_after_the_cooldown():
    a = Autoscaler(CFG, BOUNDS)
    d = a.move_to("decode", 1, 9, now=0, reason="planner: 1P4D")
    assert (d.old, d.new, d.reason) == (1, 4, "planner: 1P4D")  # clamped to the max
    assert a.move_to("decode", 4, 2, now=5, reason="x") is None  # cooling down
    assert a.move_to("decode", 4, 4, now=20, reason="x") is None  # already there
    assert a.move_to("prefill", 2, 0, now=5, reason="x").new == 1  # its own cool-down; min 1


def test_an_unreadable_planner_profile_names_the_setting(tmp_path):
    assert planner_profile(None) is None
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="autoscaler.planner_profile"):
        planner_profile(str(bad))
    with pytest.raises(ValueError, match="autoscaler.planner_profile"):
        planner_profile(str(tmp_path / "missing.json"))
