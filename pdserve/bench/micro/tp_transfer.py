"""``pdserve bench tp-transfer``: the KV transfer's share of TTFT when prefill TP=a ships to
decode TP=b, against a -> a (issue 49).

Per pair a local cluster (one prefill worker of ``a`` ranks, one decode worker of ``b``, one
thread a rank, the workers as processes) on a random model (``load_format: dummy``) of a
realistic shape, so each prompt's KV is MBs. Each cluster serves one warm-up request, then
prompts of fresh random token ids (no prefix-cache hits), one at a time (nothing queues), with
``include_timings``. Timings.kv_transfer_s is the transfer time *not* hidden behind prefill
(each prefill rank streams its own KV heads layer by layer while prefill runs; the decode
side writes each frame's heads into every rank that holds them), so share = kv_transfer_s /
ttft_s. By default each pair's cluster runs alone, one after the other (a worker of the
default shape holds about 3 GB, so four clusters at once need some 25 GB); ``--interleave``
keeps every pair's cluster up at once and sends the requests round robin, one per pair a
round, so a shared machine's slow minutes fall on every pair alike.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import signal
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

from engine.config import CacheConfig
from kv_transfer.transports import WORKER_TRANSPORTS
from pdserve.bench.micro.tp_decode import add_model_shape_arguments, dummy_model_folder

MiB = 1 << 20


@dataclass(frozen=True)
class Pair:
    prefill_tp: int
    decode_tp: int

    @property
    def name(self) -> str:
        return f"{self.prefill_tp}->{self.decode_tp}"


def parse_pairs(text: str) -> list[Pair]:
    """``"1:1,2:1"`` -> [Pair(1, 1), Pair(2, 1)]; each degree a positive integer."""
    pairs = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        try:
            a, b = (int(x) for x in item.split(":"))
        except ValueError:
            raise SystemExit(f"--pairs: {item!r} is not PREFILL_TP:DECODE_TP") from None
        if a < 1 or b < 1:
            raise SystemExit(f"--pairs: {item!r}: degrees start at 1")
        pairs.append(Pair(a, b))
    if not pairs or len(set(pairs)) != len(pairs):
        raise SystemExit(f"--pairs: {text!r}: give each pair once, at least one")
    return pairs


@dataclass(frozen=True)
class Sample:
    """One request's timings, as the router reports them."""

    prefill_s: float
    kv_transfer_s: float  # exposed: not hidden behind prefill
    ttft_s: float
    kv_bytes: int


@dataclass(frozen=True)
class PairRow:
    pair: str
    requests: int
    prefill_s: float  # medians over the requests
    kv_transfer_s: float
    ttft_s: float
    share_of_ttft: float  # median of each request's kv_transfer_s / ttft_s
    kv_bytes: int


def summarize(pair: Pair, samples: list[Sample]) -> PairRow:
    if not samples:
        raise ValueError(f"{pair.name}: no timed request")

    def median(field: str) -> float:
        return statistics.median(getattr(s, field) for s in samples)

    shares = [s.kv_transfer_s / s.ttft_s for s in samples if s.ttft_s > 0]
    return PairRow(
        pair.name, len(samples), median("prefill_s"), median("kv_transfer_s"), median("ttft_s"),
        statistics.median(shares) if shares else 0.0, int(median("kv_bytes")),
    )  # fmt: skip


@dataclass(frozen=True)
class Ratio:
    """a -> b over a -> a, same prefill degree: what changing only the decode degree did."""

    pair: str
    against: str
    kv_transfer: float | None  # None where a -> a exposed nothing (0 s)
    ttft: float
    share_points: float  # share(a -> b) - share(a -> a), in points of TTFT


def ratios(pairs: list[Pair], rows: list[PairRow]) -> list[Ratio]:
    by_name = {r.pair: r for r in rows}
    out = []
    for p in pairs:
        same = Pair(p.prefill_tp, p.prefill_tp)
        if p == same or same.name not in by_name:
            continue
        row, base = by_name[p.name], by_name[same.name]
        kv = row.kv_transfer_s / base.kv_transfer_s if base.kv_transfer_s > 0 else None
        out.append(
            Ratio(
                p.name, same.name, kv, row.ttft_s / base.ttft_s,
                100 * (row.share_of_ttft - base.share_of_ttft),
            )
        )  # fmt: skip
    return out


def format_report(rows: list[PairRow], ratio_rows: list[Ratio], setup: str) -> str:
    lines = [
        f"{' TP transfer: exposed KV transfer and TTFT, prefill TP=a -> decode TP=b ':=^86}",
        setup,
        (
            f"{'a->b':<7}{'req':>4}{'prefill s':>11}{'kv exposed s':>14}{'TTFT s':>9}"
            f"{'share':>8}{'KV MiB':>9}"
        ),
    ]
    for r in rows:
        lines.append(
            f"{r.pair:<7}{r.requests:>4}{r.prefill_s:>11.3f}{r.kv_transfer_s:>14.4f}"
            f"{r.ttft_s:>9.3f}{r.share_of_ttft:>8.2%}{r.kv_bytes / MiB:>9.1f}"
        )
    if ratio_rows:
        lines.append(f"{'a->b vs a->a':<16}{'kv exposed x':>14}{'TTFT x':>9}{'share +pts':>12}")
    for q in ratio_rows:
        kv = f"{q.kv_transfer:.2f}" if q.kv_transfer is not None else "-"
        lines.append(
            f"{q.pair + ' vs ' + q.against:<16}{kv:>14}{q.ttft:>9.2f}{q.share_points:>+12.2f}"
        )
    lines.append("=" * 86)
    return "\n".join(lines)


# ---- measuring ----------------------------------------------------------------------------

# A pair's cluster, opened: a context manager whose value sends one prompt and times it.
OpenSender = Callable[[Pair], contextlib.AbstractContextManager[Callable[[], Sample]]]


def collect_samples(
    pairs: list[Pair], requests: int, open_sender: OpenSender, interleave: bool = False
) -> dict[Pair, list[Sample]]:
    """``requests`` timed samples per pair after one untimed warm-up each. ``interleave``:
    every pair's cluster open at once, one request per pair a round; else each cluster alone,
    one after the other."""
    out: dict[Pair, list[Sample]] = {p: [] for p in pairs}
    groups = [pairs] if interleave else [[p] for p in pairs]
    for group in groups:
        with contextlib.ExitStack() as stack:
            senders = {p: stack.enter_context(open_sender(p)) for p in group}
            for send in senders.values():
                send()  # warm-up: first-call costs (allocations, connections) untimed
            for _ in range(requests):
                for p, send in senders.items():
                    out[p].append(send())
    return out


@dataclass(frozen=True)
class ClusterShape:
    """What every pair's cluster shares."""

    model_dir: str
    load_format: str  # dummy: random weights of the folder's config.json
    transport: str
    prompt_tokens: int
    processes: bool


@contextlib.contextmanager
def open_cluster(pair: Pair, shape: ClusterShape, seed: int):
    """A one-prefill, one-decode cluster at ``pair``'s degrees; yields a function that sends
    one prompt of fresh random ids and returns its timings."""
    import numpy as np

    from engine.loader import load_config
    from pdserve.client import Client
    from pdserve.cluster.local import ClusterSpec, LocalCluster

    block = CacheConfig.block_size
    per_request = math.ceil((shape.prompt_tokens + 16) / block)
    pools = {
        "prefill": {"threads": 1, "tensor_parallel_size": pair.prefill_tp},
        "decode": {"threads": 1, "tensor_parallel_size": pair.decode_tp},
    }
    spec = ClusterSpec(
        model=shape.model_dir, kv_transport=shape.transport, load_format=shape.load_format,
        block_size=block, num_blocks=3 * per_request, max_model_len=per_request * block,
        max_num_batched_tokens=max(512, shape.prompt_tokens), pools=pools,
        separate_processes=shape.processes,
    )  # fmt: skip
    rng = np.random.default_rng(seed)

    with LocalCluster(spec) as cluster, Client(cluster.address) as client:
        vocab = load_config(cluster.model_dir).vocab_size
        low = 3 if vocab < 1000 else 100  # stay clear of special tokens

        def send() -> Sample:
            ids = rng.integers(low, vocab, shape.prompt_tokens).tolist()
            t = client.generate(token_ids=ids, max_tokens=2, include_timings=True).timings
            if t is None:
                raise RuntimeError(f"{pair.name}: the router returned no timings")
            return Sample(t.prefill_s, t.kv_transfer_s, t.ttft_s, int(t.kv_bytes))

        yield send


def random_model_folder(args) -> str:
    """dummy_model_folder's config.json plus a word-level tokenizer over its vocabulary: the
    router reads a tokenizer from the model folder, though these prompts are token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = dummy_model_folder(args)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(args.vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


def _setup_line(args, shape: ClusterShape) -> str:
    head_dim = args.hidden // args.heads
    kv = 2 * args.layers * args.prompt_tokens * args.kv_heads * head_dim * 4
    model = (
        f"random llama: {args.layers} layers, hidden {args.hidden}, {args.heads} q / "
        f"{args.kv_heads} kv heads x {head_dim} ({kv / MiB:.1f} MiB fp32 KV a prompt)"
        if args.model is None
        else f"model {args.model}"
    )
    mode = "pairs interleaved per request" if args.interleave else "one cluster at a time"
    return (
        f"{model}; {args.prompt_tokens}-token prompts; transport {shape.transport}; 1 thread a rank; "
        f"workers as {'processes' if shape.processes else 'threads'}; {mode}; "
        f"{args.requests} requests a pair after 1 warm-up"
    )


def cmd_tp_transfer(args) -> int:
    pairs = parse_pairs(args.pairs)
    # SIGTERM unwinds like Ctrl-C, so every open cluster stops its worker processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    folder = random_model_folder(args) if args.model is None else None
    shape = ClusterShape(
        folder or args.model, "dummy" if folder else "auto", args.transport,
        args.prompt_tokens, not args.in_process,
    )  # fmt: skip
    try:
        samples = collect_samples(
            pairs,
            args.requests,
            lambda p: open_cluster(p, shape, seed=args.seed + 1000 * p.prefill_tp + p.decode_tp),
            args.interleave,
        )
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    rows = [summarize(p, samples[p]) for p in pairs]
    ratio_rows = ratios(pairs, rows)
    print(format_report(rows, ratio_rows, _setup_line(args, shape)))
    if args.json_out:
        report = {
            "setup": _setup_line(args, shape),
            "pairs": [asdict(r) for r in rows],
            "ratios": [asdict(q) for q in ratio_rows],
            "samples": {p.name: [asdict(s) for s in samples[p]] for p in pairs},
        }
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    print(f"{sum(map(len, samples.values()))} timed requests", file=sys.stderr)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "tp-transfer", help="KV transfer's share of TTFT, prefill TP=a -> decode TP=b vs a -> a"
    )
    p.add_argument("--pairs", default="1:1,2:1,1:2,2:2", help="PREFILL_TP:DECODE_TP, ...")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--requests", type=int, default=6, help="timed requests a pair")
    p.add_argument("--transport", default="grpc", choices=WORKER_TRANSPORTS)
    p.add_argument(
        "--interleave",
        action="store_true",
        help="every pair's cluster up at once, one request per pair a round (memory: all of them)",
    )
    p.add_argument("--in-process", action="store_true", help="rank 0s as threads of this process")
    p.add_argument(
        "--model",
        default=None,
        help="a model folder or name; default: random weights (dummy) of the shape flags' config",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", default=None, help="medians and every sample")
    add_model_shape_arguments(p)
    p.set_defaults(func=cmd_tp_transfer)
