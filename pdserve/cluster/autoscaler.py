"""Pool autoscaling decisions: pure logic, no Ray, so it is tested alone.

Each pool has its own signal and bounds:
  prefill -- queued prompt tokens per worker, as seconds of prefill work, and the observed TTFT,
             against the TTFT target;
  decode  -- observed time per output token (mean inter-token latency) against the TPOT target,
             and KV-cache usage against ``kv_high`` / ``kv_low``.
A pool grows by one when a signal is over target, shrinks by one when every signal is under
``low_ratio`` x target (no observations in the window counts as idle), and after any change
waits ``cooldown_s`` before the next so it does not flap.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import AutoscalerConfig


@dataclass(frozen=True)
class PoolSignal:
    size: int  # workers serving now (starting ones excluded)
    queued_prompt_tokens: int = 0  # summed over the pool (prefill)
    kv_usage: float = 0.0  # mean fraction of KV blocks in use (decode)
    ttft_s: float | None = None  # mean over the window; None: no requests finished
    tpot_s: float | None = None


@dataclass(frozen=True)
class Decision:
    role: str
    old: int
    new: int
    reason: str


class Autoscaler:
    def __init__(self, cfg: AutoscalerConfig, bounds: dict[str, tuple[int, int]]):
        self.cfg = cfg
        self.bounds = bounds  # role -> (min, max)
        self._last_change: dict[str, float] = {}

    def decide(self, role: str, target: int, signal: PoolSignal, now: float) -> Decision | None:
        """The new target for ``role``, or None to keep it."""
        if now - self._last_change.get(role, float("-inf")) < self.cfg.cooldown_s:
            return None
        pressure, reason = self._pressure(role, signal)
        return self.move_to(role, target, target + pressure, now, reason)

    def move_to(self, role: str, target: int, wanted: int, now: float, reason: str):
        """A Decision taking ``role`` from ``target`` to ``wanted`` (clamped to its bounds), or
        None while it cools down or when nothing changes (``decide``'s step, and the planner
        mode's)."""
        if now - self._last_change.get(role, float("-inf")) < self.cfg.cooldown_s:
            return None
        lo, hi = self.bounds[role]
        new = max(lo, min(hi, wanted))
        if new == target:
            return None
        self._last_change[role] = now
        return Decision(role, target, new, reason)

    def _pressure(self, role: str, s: PoolSignal) -> tuple[int, str]:
        """+1: over target, -1: comfortably under, 0: hold."""
        return self._prefill_pressure(s) if role == "prefill" else self._decode_pressure(s)

    def _prefill_pressure(self, s: PoolSignal) -> tuple[int, str]:
        c = self.cfg
        queue_s = s.queued_prompt_tokens / max(s.size, 1) / c.prefill_tokens_per_s
        ttft = s.ttft_s
        if queue_s > c.ttft_target_s:
            return 1, f"queued prompts need {queue_s:.2f}s > TTFT target {c.ttft_target_s}s"
        if ttft is not None and ttft > c.ttft_target_s:
            return 1, f"TTFT {ttft:.3f}s > target {c.ttft_target_s}s"
        low = c.low_ratio * c.ttft_target_s
        if queue_s < low and (ttft is None or ttft < low):
            return -1, "TTFT well under target" if ttft is not None else "no prefill load"
        return 0, ""

    def _decode_pressure(self, s: PoolSignal) -> tuple[int, str]:
        c = self.cfg
        tpot = s.tpot_s
        if tpot is not None and tpot > c.tpot_target_s:
            return 1, f"TPOT {tpot * 1e3:.1f}ms > target {c.tpot_target_s * 1e3:.1f}ms"
        if s.kv_usage > c.kv_high:
            return 1, f"KV usage {s.kv_usage:.0%} > {c.kv_high:.0%}"
        if s.kv_usage < c.kv_low and (tpot is None or tpot < c.low_ratio * c.tpot_target_s):
            return -1, "TPOT well under target" if tpot is not None else "no decode load"
        return 0, ""


def latency_summary(
    observations: list[tuple[float, float, float | None]], now: float, window_s: float
) -> tuple[float | None, float | None]:
    """Mean TTFT and mean TPOT of requests that finished in the last ``window_s`` seconds;
    ``observations`` are (finish time, ttft_s, tpot_s or None for one-token requests)."""
    recent = [o for o in observations if now - o[0] <= window_s]
    if not recent:
        return None, None
    ttft = sum(o[1] for o in recent) / len(recent)
    tpots = [o[2] for o in recent if o[2] is not None]
    return ttft, (sum(tpots) / len(tpots) if tpots else None)


def planner_profile(path: str | None):
    """The planner mode's profile, loaded once at start (None: the reactive mode); an unreadable
    file is an error naming the setting."""
    if not path:
        return None
    from pdserve.planner.profile import load_profile  # only in the planner mode

    try:
        return load_profile(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"autoscaler.planner_profile: cannot read {path!r}: {e}") from e
