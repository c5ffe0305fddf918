"""``pdserve bench engine``: prefill MFU and decode MBU of the engine against this machine's
measured GEMM peak and read bandwidth, beside ``transformers`` on the same workloads and threads.

Useful prefill FLOPs = 2 x non-embedding params x tokens + causal attention + the LM head for
the last token only; prefill MFU divides them by the measured GEMM peak of the dtype the
prefill's matmuls run in (``--prefill-gemm``: fp32, or bf16 where engine/prefill_gemm.py
chooses it; the bf16 peak is measured in the same run when a row needs it). Decode bytes = every weight the step reads as it is stored (LM head
included, embedding rows excluded: fp32, or the quantized codes and scales with ``--weights``)
+ the KV cache of every sequence in its dtype (``--kv-dtypes fp32,int8``: each cache format
timed on the same engine, workload by workload; int8 counts its codes and scales).

``--cpu-kernels avx512,avx2,torch`` times each CPU kernel variant on the same engine, workload
by workload (interleaved: a shared machine's slow spells fall on every variant alike); every
result names the CPU, its instruction sets and the variant of each row.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

import torch

from engine import hugepages
from kernels import cpu_extension
from pdserve.bench.micro.limits import gemm_peak, read_bandwidth
from pdserve.measure.timing import best_time


@dataclass
class Row:
    kind: str  # "prefill" | "decode"
    batch: int
    tokens: int  # prompt length (prefill) or context length (decode)
    seconds: float  # per prefill, or per decode step
    hf_seconds: float
    ratio: float  # MFU (prefill) or MBU (decode)
    hf_ratio: float
    cpu_kernels: str = ""  # the extension's variant: avx512vnni | avx512 | avx2 | torch
    weights: str = "fp32"  # fp32 | bf16 | int8 | q4
    bytes_read: float = 0.0  # decode: weights + KV read per step, as stored
    kv_dtype: str = "fp32"  # the KV cache: fp32 | int8
    prefill_gemm: str = "fp32"  # prefill: the dtype its many-row matmuls ran in (fp32 | bf16)

    @property
    def speedup(self) -> float:
        return self.hf_seconds / self.seconds


def model_costs(cfg):
    embed = cfg.vocab_size * cfg.hidden_size
    per_layer = (
        cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size)
        + cfg.q_size * cfg.hidden_size
        + 3 * cfg.hidden_size * cfg.intermediate_size
        + 2 * cfg.hidden_size
    )
    non_embedding = cfg.num_layers * per_layer + cfg.hidden_size
    return embed, non_embedding


def prefill_flops(cfg, n: int) -> float:
    embed, non_embedding = model_costs(cfg)
    attention = 2 * 2 * (n * (n + 1) / 2) * cfg.q_size * cfg.num_layers  # QK^T and PV, causal
    return 2 * non_embedding * n + attention + 2 * embed


def decode_bytes(
    cfg, batch: int, context: int, weight_bytes: float | None = None, kv_dtype: str = "fp32"
) -> float:
    """Bytes a decode step reads: ``weight_bytes`` (default: every weight in fp32) + the KV."""
    embed, non_embedding = model_costs(cfg)
    kv = batch * context * cfg.kv_bytes_per_token_as(kv_dtype)
    return (4 * (non_embedding + embed) if weight_bytes is None else weight_bytes) + kv


def model_weight_bytes(model) -> int:
    """What one decode step reads of ``model``'s weights as they are stored now (quantized
    tiles where the quantized kernel runs, fp32 elsewhere), norms included."""
    norms = sum(p.numel() * 4 for n, p in model.named_parameters() if n.endswith("norm.weight"))
    return model.weight_bytes_per_step() + norms


ISA_LIMIT_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
# Timed repetitions (the fastest counts): decode steps, and prefills (slower, fewer).
REPS = 5


def _prefill_reps(reps: int) -> int:
    return max(3, reps // 3)


class EngineRunner:
    """Times the engine's forward directly (no scheduler), as the workers call it."""

    def __init__(self, engine, reps: int = REPS):
        self.reps = reps
        self.engine = engine
        self.runner = engine.runner
        self.bs = engine.config.cache.block_size

    def _batch(self, batch: int, context: int, new: int):
        from engine.block_manager import blocks_for
        from engine.request import Request
        from engine.scheduler import ScheduledSequence

        seqs = []
        next_block = 0
        for i in range(batch):
            req = Request(f"b{i}", [5 + i % 100] * context)
            n_blocks = blocks_for(context + 1, self.bs)
            req.block_table = list(range(next_block, next_block + n_blocks))
            next_block += n_blocks
            req.num_computed_tokens = context - new
            seqs.append(ScheduledSequence(req, new, True))
        return seqs

    def prefill_seconds(self, n: int) -> float:
        seqs = self._batch(1, n, n)
        return best_time(lambda: self.runner.execute(seqs), _prefill_reps(self.reps), warmup=1)

    def decode_seconds(self, batch: int, context: int) -> float:
        seqs = self._batch(batch, context, 1)
        return best_time(lambda: self.runner.execute(seqs), reps=self.reps, warmup=2)


def use_cpu_kernels(model, variant: str) -> None:
    """Run the model's CPU layers on ``variant`` (a build of the extension, or ``torch``) from
    now on: the skinny tiles and the C++ layers are rebuilt from that build."""
    from engine.linear import Linear

    cpu_extension.use(variant)
    for m in model.modules():
        if isinstance(m, Linear):
            m.skinny = None
    model.pack_weights_for_cpu()


class HFRunner:
    def __init__(self, model_dir, reps: int = REPS):
        from transformers import AutoModelForCausalLM

        self.reps = reps
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32
        ).eval()

    @torch.inference_mode()
    def prefill_seconds(self, n: int) -> float:
        ids = torch.full((1, n), 5)
        return best_time(lambda: self.model(ids), _prefill_reps(self.reps), warmup=1)

    @torch.inference_mode()
    def decode_seconds(self, batch: int, context: int) -> float:
        ids = torch.full((batch, context), 5)
        out = self.model(ids, use_cache=True)
        step = torch.full((batch, 1), 6)

        def one_step():
            cache = out.past_key_values
            self.model(step, past_key_values=cache, use_cache=True)
            cache.crop(-1)  # drop the step just added: the context stays fixed across repetitions

        return best_time(one_step, reps=self.reps, warmup=2)


def run(
    model: str = "embedded",
    threads: int = 0,
    prompt_lens=(128, 512, 1024),
    batches=(1, 8, 32),
    contexts=(256, 1024),
    baseline: bool = True,
    cpu_kernels: tuple[str, ...] = (),
    reps: int = REPS,
    weights: tuple[str, ...] = ("fp32",),
    kv_dtype: str = "fp32",
    kv_dtypes: tuple[str, ...] = (),
    prefill_gemm: tuple[str, ...] = ("auto",),
) -> dict:
    """``cpu_kernels``: the variants to time side by side (default: the one chosen here);
    ``weights``: the weight formats, one engine each, timed on the same workloads;
    ``kv_dtypes``: the KV cache formats, each its own cache on the same engine (default:
    ``kv_dtype`` alone); ``prefill_gemm``: prefill matmul precisions (fp32 | bf16 | int8 | auto), one
    engine per format and precision."""
    kv_dtypes = kv_dtypes or (kv_dtype,)
    if threads:
        torch.set_num_threads(threads)
    variants = cpu_kernels or (cpu_extension.selected_variant(),)
    peaks = GemmPeaks(gemm_peak())
    bandwidth = read_bandwidth()
    hf_seconds: dict[tuple, float] = {}  # transformers once per workload, for every format
    rows = []
    for fmt, gemm in [(f, g) for f in weights for g in prefill_gemm]:
        model_dir, engine = _engine(model, prompt_lens, batches, contexts, fmt, kv_dtypes[0], gemm)
        if baseline and not hf_seconds:
            hf = HFRunner(model_dir, reps)
            hf_seconds.update({("prefill", n): hf.prefill_seconds(n) for n in prompt_lens})
            hf_seconds.update(
                {("decode", b, c): hf.decode_seconds(b, c) for b in batches for c in contexts}
            )
            del hf
        rows += _rows_of(engine, fmt, kv_dtypes, variants, reps, hf_seconds, peaks, bandwidth,
                         prompt_lens, batches, contexts)  # fmt: skip
        del engine
    return {
        **cpu_extension.describe(),
        "cpu_kernels": list(variants),
        # torch's own kernels, oneDNN and MKL: what they were allowed (an AVX2-only emulation
        # on an AVX-512 machine caps them with these variables).
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "isa_limits": {k: os.environ[k] for k in ISA_LIMIT_VARS if k in os.environ},
        "threads": torch.get_num_threads(),
        "huge_pages": hugepages.active(),
        "gemm_peak_gflops": peaks.fp32 / 1e9,
        "gemm_peak_bf16_gflops": None if peaks.bf16 is None else peaks.bf16 / 1e9,
        "gemm_peak_int8_gops": None if peaks.int8 is None else peaks.int8 / 1e9,
        "read_bandwidth_gbs": bandwidth / 1e9,
        "kv_dtype": kv_dtypes[0],
        "kv_dtypes": list(kv_dtypes),
        "rows": [{**asdict(r), "speedup": r.speedup} for r in rows],
    }


class GemmPeaks:
    """The fp32 GEMM peak, and the bf16 and int8 ones measured the first time a row needs them
    (a CPU without bf16 instructions emulates it: seconds a run with no bf16 rows need not
    spend). An int8 prefill's MFU is against the int8 peak (oneDNN's int8 GEMM)."""

    def __init__(self, fp32: float):
        self.fp32, self.bf16, self.int8 = fp32, None, None

    def of(self, dtype: str) -> float:
        if dtype == "fp32":
            return self.fp32
        if dtype == "int8":
            if self.int8 is None:
                self.int8 = gemm_peak(dtype=torch.int8)
            return self.int8
        if self.bf16 is None:
            self.bf16 = gemm_peak(dtype=torch.bfloat16)
        return self.bf16


def _rows_of(engine, fmt, kv_dtypes, variants, reps, hf_seconds, peaks, bandwidth,
             prompt_lens, batches, contexts) -> list[Row]:  # fmt: skip
    """Every workload on ``engine`` under each variant and KV format in turn (interleaved per
    workload: a shared machine's slow spells fall on each alike)."""
    from engine.model_runner import ModelRunner

    cfg, model = engine.config.model, engine.runner.model
    ours = EngineRunner(engine, reps)
    blocks = engine.config.cache.num_blocks
    runners = {kv: engine.runner if kv == engine.runner.kv_dtype else
               ModelRunner(model, blocks, ours.bs, kv) for kv in kv_dtypes}  # fmt: skip
    nan = float("nan")

    def timed(measure, *args) -> dict[tuple[str, str], tuple[float, int]]:
        """Seconds of ``measure(*args)`` and the weight bytes read, per (variant, KV format)."""
        out = {}
        for v in variants:
            if len(variants) > 1:
                use_cpu_kernels(model, v)
            for kv in kv_dtypes:
                ours.runner = runners[kv]
                out[v, kv] = measure(*args), model_weight_bytes(model)
        return out

    rows = []
    for n in prompt_lens:
        t_hf = hf_seconds.get(("prefill", n), nan)
        flops, gemm = prefill_flops(cfg, n), model.gemm_dtype_for(n)
        for (v, kv), (t, _) in timed(ours.prefill_seconds, n).items():
            mfu, hf_mfu = flops / t / peaks.of(gemm), flops / t_hf / peaks.fp32
            rows.append(Row("prefill", 1, n, t, t_hf, mfu, hf_mfu, v, fmt, kv_dtype=kv,
                            prefill_gemm=gemm))  # fmt: skip
    for b in batches:
        for c in contexts:
            t_hf = hf_seconds.get(("decode", b, c), nan)
            hf_mbu = decode_bytes(cfg, b, c) / t_hf / bandwidth  # fp32 weights and KV
            for (v, kv), (t, wbytes) in timed(ours.decode_seconds, b, c).items():
                nbytes = decode_bytes(cfg, b, c, wbytes, kv)
                rows.append(Row("decode", b, c, t, t_hf, nbytes / t / bandwidth, hf_mbu, v, fmt,
                                nbytes, kv))  # fmt: skip
    return rows


def _engine(
    model: str,
    prompt_lens,
    batches,
    contexts,
    weights="fp32",
    kv_dtype="fp32",
    gemm="auto",
    activations="int8",
):
    """The model's directory and an engine with blocks for the largest workload."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from engine.loader import load_config, load_model
    from engine.model_files import resolve_model_dir
    from engine.tokenizer import Tokenizer

    model_dir = resolve_model_dir(model)
    max_ctx = max(max(prompt_lens), max(contexts)) + 16
    # Enough blocks for the largest decode batch and for the longest prompt.
    blocks = max(max(batches) * (max(contexts) // 16 + 2), max(prompt_lens) // 16 + 2) + 8
    cfg = load_config(model_dir)
    max_len = min(max_ctx + 16, cfg.max_position_embeddings)
    engine_cfg = EngineConfig(
        cfg, CacheConfig(16, blocks), SchedulerConfig(max_ctx), max_len, weights,
        kv_dtype=kv_dtype, prefill_gemm=gemm, activations=activations,
    )  # fmt: skip
    tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None
    loaded = load_model(
        model_dir, cfg, max_len, weights=weights, prefill_gemm=gemm, activations=activations
    )
    engine = LLMEngine(engine_cfg, loaded, tokenizer)
    return model_dir, engine


def format_report(result: dict) -> str:
    lines = [
        (
            f"CPU {result.get('cpu_model', '?')}  instruction sets {result.get('cpu_isa', '?')}  "
            f"kernels {', '.join(result.get('cpu_kernels', []))}  torch "
            f"{result.get('torch_cpu_capability', '?')} {result.get('isa_limits') or ''}"
        ),
        (
            f"threads {result['threads']}  GEMM peak {result['gemm_peak_gflops']:.1f} GFLOP/s"
            f"{_bf16_peak_text(result)}  "
            f"read bandwidth {result['read_bandwidth_gbs']:.1f} GB/s  "
            f"huge pages {'on' if result.get('huge_pages') else 'off'}"
        ),
        (
            f"{'phase':<8}{'batch':>6}{'tokens':>8}{'kernels':>9}{'weights':>8}{'kv':>5}"
            f"{'gemm':>6}{'pdserve ms':>12}"
            f"{'hf ms':>10}"
            f"{'ratio':>8}{'hf ratio':>10}{'speedup':>9}   ratio = MFU (prefill) / MBU (decode)"
        ),
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['kind']:<8}{r['batch']:>6}{r['tokens']:>8}{r.get('cpu_kernels', ''):>9}"
            f"{r.get('weights', 'fp32'):>8}{r.get('kv_dtype', 'fp32'):>5}{_gemm_text(r):>6}"
            f"{r['seconds'] * 1e3:>12.1f}{r['hf_seconds'] * 1e3:>10.1f}{r['ratio']:>8.2f}"
            f"{r['hf_ratio']:>10.2f}{r['speedup']:>8.2f}x"
        )
    return "\n".join(lines)


def _gemm_text(row: dict) -> str:
    return row.get("prefill_gemm", "fp32") if row["kind"] == "prefill" else ""


def _bf16_peak_text(result: dict) -> str:
    peaks = [(k, result.get(f"gemm_peak_{k}")) for k in ("bf16_gflops", "int8_gops")]
    text = ", ".join(f"{k.split('_')[0]} {p:.1f}" for k, p in peaks if p is not None)
    return f" ({text})" if text else ""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "engine", help="prefill MFU / decode MBU vs measured limits and transformers"
    )
    p.add_argument("--model", default="embedded")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--prompt-lens", default="128,512,1024")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--contexts", default="256,1024")
    p.add_argument("--no-baseline", action="store_true", help="skip transformers")
    p.add_argument("--reps", type=int, default=REPS, help="timed decode steps (best counts)")
    p.add_argument(
        "--cpu-kernels",
        default="",
        help="CPU kernel variants to time side by side, e.g. avx512,avx2,torch "
        "(default: the one chosen for this CPU)",
    )
    p.add_argument(
        "--weights",
        default="fp32",
        help="weight formats to time side by side: fp32,bf16,int8,q4 (q4: groups of 32)",
    )
    p.add_argument(
        "--kv-dtypes",
        "--kv-dtype",
        dest="kv_dtypes",
        default="fp32",
        help="KV cache formats to time side by side on the same engine, e.g. fp32,int8",
    )
    p.add_argument(
        "--prefill-gemm",
        default="auto",
        help="prefill matmul precisions to time side by side: fp32,bf16,int8,auto (auto: the "
        "fastest of bf16 and int8 for quantized weights where it beats fp32); prefill MFU is "
        "against that dtype's peak (int8: oneDNN's int8 GEMM)",
    )
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=_main)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _main(args) -> int:
    started = time.time()
    result = run(
        args.model,
        args.threads,
        _ints(args.prompt_lens),
        _ints(args.batches),
        _ints(args.contexts),
        baseline=not args.no_baseline,
        cpu_kernels=tuple(v for v in args.cpu_kernels.split(",") if v),
        reps=args.reps,
        weights=tuple(w for w in args.weights.split(",") if w),
        kv_dtypes=tuple(k for k in args.kv_dtypes.split(",") if k),
        prefill_gemm=tuple(g for g in args.prefill_gemm.split(",") if g),
    )
    print(format_report(result))
    print(f"({time.time() - started:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
