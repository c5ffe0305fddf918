"""What a profile's tables miss when workers share a few CPU cores: fitted corrections.

The tables time one bare engine with the machine to itself. Workers that share one small
machine's cores also slow each other down, and the router and its client spend CPU on the same
cores. These fields price that; each defaults to the value that changes nothing, so a GPU
profile (every worker on its own device) carries none. ``pdserve profile --cpu-corrections``
measures the co-run slowdowns; the rest are fitted from live step traces by the lab
(``pdserve bench fidelity``). In a profile's JSON they are top-level keys beside the tables.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

# The decode-kind and prefill-kind fixed work, scaled with that kind's speed (at_speed).
_DECODE_FIXED = ("co_run_fixed_s", "co_run_fixed_s_decode_pair")
_PREFILL_FIXED = ("co_run_fixed_s_prefill", "co_run_fixed_s_local_prefill")


@dataclass(frozen=True)
class CpuCorrections:
    # A step's slowdown while another worker computes beside it (shared memory bandwidth and
    # caches, or vCPUs that are one core's hyperthreads): a decode step's beside a prefill.
    co_run_slowdown: float = 1.0
    # A prefill step's beside a decode step (None: the decode step's figure).
    co_run_slowdown_prefill: float | None = None
    # The same-kind pairs: decode beside decode, prefill beside prefill (None: the kind's).
    co_run_slowdown_decode_pair: float | None = None
    co_run_slowdown_prefill_pair: float | None = None
    # Work (seconds of the step alone) a step pays once when a neighbour first computes beside
    # it, before the slowdown applies: a worker's own per-step Python (plan, sample, KV frames)
    # loses its core to the neighbour's forward, which costs a short step as much as a long one.
    co_run_fixed_s: float = 0.0  # a decode step's
    co_run_fixed_s_prefill: float = 0.0  # a prefill worker's prompt step's
    # A decode (colocated) worker's own prompt step's: it streams no KV frames out (None: the
    # prefill worker's figure).
    co_run_fixed_s_local_prefill: float | None = None
    # A decode step's beside another decode step only: a fixed cost at every batch rather
    # than a share of the step (None: ``co_run_fixed_s``).
    co_run_fixed_s_decode_pair: float | None = None
    # A prompt step's claim on the cores against a decode step's 1 when more threads compute
    # than there are cores: the OS scheduler may favour decode workers, which sleep between
    # steps, over a long CPU-bound prefill (CpuShare.shares). 1: fair.
    oversubscribed_prefill_weight: float = 1.0
    # A prefill step in a disaggregated prefill worker over the bare engine's: the worker
    # builds and sends each layer's KV frames on the cores the forward runs on.
    prefill_worker_slowdown: float = 1.0
    # A decode-only step in a live decode worker over the bare engine's, no neighbour busy:
    # its gRPC threads stream every token out on the same cores.
    decode_worker_slowdown: float = 1.0
    # A live decode-only step over its price, one factor per decode table row (batch size):
    # a table timed once can get the batch's shape wrong by more than noise. (): 1 everywhere.
    decode_row_factors: tuple[float, ...] = ()
    # What a disaggregated request's first token waits beyond ``router_overhead_s`` live: the
    # calls reaching busy worker processes, and the token's way back beside KV frames.
    disaggregated_hop_s: float = 0.0
    # CPU the router and its client spend on the workers' cores: per request (tokenize,
    # template, reserve, prefill call) and per streamed token (receive, detokenize, SSE);
    # and the decode worker's gRPC threads per streamed token.
    router_cpu_per_request_s: float = 0.0
    router_cpu_per_token_s: float = 0.0
    stream_cpu_per_token_s: float = 0.0

    @property
    def local_prefill_fixed_s(self) -> float:
        """The once-per-step co-run work of a decode worker's own prompt step."""
        if self.co_run_fixed_s_local_prefill is None:
            return self.co_run_fixed_s_prefill
        return self.co_run_fixed_s_local_prefill

    @property
    def co_run_pairs(self) -> dict[tuple[str, str], float | None]:
        """(kind, neighbour kind) -> slowdown, for the same-kind pairs (CpuShare's ``pairs``)."""
        return {
            ("decode", "decode"): self.co_run_slowdown_decode_pair,
            ("prefill", "prefill"): self.co_run_slowdown_prefill_pair,
        }

    def at_speed(self, decode: float, prefill: float) -> CpuCorrections:
        """The fixed work is seconds of a step alone: it scales with its kind's speed; the
        slowdowns and shares are ratios, kept."""
        scaled = {k: _times(getattr(self, k), decode) for k in _DECODE_FIXED}
        scaled.update({k: _times(getattr(self, k), prefill) for k in _PREFILL_FIXED})
        return replace(self, **scaled)

    @classmethod
    def from_dict(cls, d: dict, decode_rows: int) -> CpuCorrections:
        """From a profile's top-level keys; a key an older profile lacks takes its default."""
        out = {}
        for f in fields(cls):
            if f.name not in d or f.name == "decode_row_factors":
                continue
            value = d[f.name]
            out[f.name] = None if value is None and f.default is None else float(value)
        factors = tuple(float(x) for x in d.get("decode_row_factors") or ())
        if factors and len(factors) != decode_rows:
            raise ValueError("decode_row_factors needs one factor per decode table row")
        return cls(**out, decode_row_factors=factors)


def _times(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor
