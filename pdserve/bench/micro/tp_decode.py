"""``pdserve bench tp-decode``: a decode step at TP=k (``threads / k`` torch threads a rank)
against TP=1 (``threads`` threads), same model, same batch, same run, rounds interleaved so a
shared machine's slow spells fall on every engine alike.

Rows: TP=1 as it serves (the fused C++ decoder layers), TP=1 on the per-layer path a TP rank
runs (the same Python layers, no collectives: what leaving the fused path costs apart from the
all-reduces), TP=1 on one rank's threads (threads / k: on a shared machine a multi-threaded
step also pays for OpenMP barriers behind descheduled threads, which this row shows), and TP=k. The model is random (``load_format: dummy``) of a shape given by flags:
only its bytes and shapes matter to a step's time.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.llm_engine import build_engine
from engine.request import SamplingParams
from engine.settings import EngineSettings


def dummy_model_folder(args) -> Path:
    """A folder holding only the config.json of a Llama of ``args``' shape (the flags of
    ``add_model_shape_arguments``), for ``load_format: dummy``."""
    cfg = {
        "model_type": "llama", "vocab_size": args.vocab, "hidden_size": args.hidden,
        "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "eos_token_id": 2,
    }  # fmt: skip
    folder = Path(tempfile.mkdtemp(prefix="pdserve-tp-bench-"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _fill(engine, args) -> None:
    """``batch`` sequences of ``context`` prompt tokens, prefilled: every later step decodes."""
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=100_000, min_tokens=100_000)
    for _ in range(args.batch):
        engine.add_request(
            torch.randint(3, args.vocab, (args.context,), generator=g).tolist(), params
        )
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()


def _step_ms(engine, threads: int, steps: int) -> float:
    torch.set_num_threads(threads)  # rank 0 shares this process with the other engines
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1e3


def cmd_tp_decode(args) -> None:
    folder = dummy_model_folder(args)
    base = EngineSettings(
        str(folder), num_blocks=args.batch * (args.context // 16 + 40), device="cpu",
        load_format="dummy", max_num_seqs=args.batch,
    )  # fmt: skip
    tp1 = build_engine(EngineSettings(**{**base.__dict__, "threads": args.threads}))
    per_layer = build_engine(EngineSettings(**{**base.__dict__, "threads": args.threads}))
    per_layer.runner.model.cpu_stack = None  # the per-layer path a TP rank runs
    k = args.tp
    tpk = build_engine(
        EngineSettings(**{**base.__dict__, "threads": args.threads // k, "tensor_parallel_size": k})
    )
    rows = {"tp1_fused": (tp1, args.threads), "tp1_per_layer": (per_layer, args.threads)}
    # TP=1 on one rank's threads: what k ranks would each take alone, with no collective.
    rows[f"tp1_fused_{args.threads // k}_threads"] = (tp1, args.threads // k)
    rows[f"tp{k}"] = (tpk, args.threads // k)
    engines = list({id(e): e for e, _ in rows.values()}.values())
    try:
        for engine in engines:
            _fill(engine, args)
        times: dict[str, list[float]] = {name: [] for name in rows}
        for i in range(args.rounds + 1):  # the first round warms each engine up, untimed
            for name, (engine, threads) in rows.items():
                ms = _step_ms(engine, threads, args.steps)
                if i:
                    times[name].append(ms)
    finally:
        for engine in engines:
            engine.close()
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    result = {
        "shape": {k_: getattr(args, k_) for k_ in ("layers", "hidden", "heads", "kv_heads",
                                                    "intermediate", "vocab")},
        "batch": args.batch, "context": args.context, "threads": args.threads, "tp": k,
        "step_ms_median": medians,
        f"tp{k}_over_tp1_fused": medians[f"tp{k}"] / medians["tp1_fused"],
        f"tp{k}_over_tp1_per_layer": medians[f"tp{k}"] / medians["tp1_per_layer"],
    }  # fmt: skip
    print(json.dumps(result, indent=2))


def add_parser(sub) -> None:
    p = sub.add_parser("tp-decode", help="decode step at TP=k vs TP=1 on the same cores")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="TP=1's threads; TP=k: threads / k")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=10, help="decode steps per timed round")
    p.add_argument("--rounds", type=int, default=7)
    add_model_shape_arguments(p)
    p.set_defaults(func=cmd_tp_decode)


def add_model_shape_arguments(p) -> None:
    """The random model's shape (default: 24 layers, hidden 768, 12 query / 4 KV heads)."""
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=49152)
