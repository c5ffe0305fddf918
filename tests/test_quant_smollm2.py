"""Quantized weights on the embedded SmolLM2-135M (a Q4_1 GGUF): perplexity on a fixed
public-domain text within 3% (int8) and 8% (q4) of fp32, and int8's greedy choices equal
fp32's on at least 90% of the first 32 positions of the chat prompts. With bf16 prefill
matmuls (``prefill_gemm: bf16``, engine/prefill_gemm.py), and with a prefill's rows quantized
to int8 as decode's are (``prefill_gemm: int8``), the same bounds hold against fp32 weights
with fp32 prefill.

Decode steps of int8 and q4 weights multiply int8 activations (``activations: int8``, the
default; kernels/csrc/quant_dot_cpu.cpp): the same bounds hold on logits taken one decode step
at a time, which is the path those kernels run (a prefill's many rows multiply fp32 ones).

Agreement is counted per position on fp32's own greedy continuation (each position's next
token given the same prefix): once two free-running generations part at a near tie, every
later position compares different texts, which says nothing about the weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine.loader import load_config, load_model, resolve_model_dir
from engine.request import SamplingParams
from engine.tokenizer import Tokenizer
from kernels.metadata import AttentionMetadata
from tests.conftest import needs_embedded
from tests.test_engine_greedy_smollm2 import QUESTIONS

pytestmark = [pytest.mark.slow, needs_embedded]

TEXT = Path(__file__).parent / "data" / "pride_and_prejudice_ch1.txt"
POSITIONS = 32


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model_dir("embedded", progress=False)


# (weights, prefill_gemm) of each model the tests read.
MODELS = [
    *[("fp32", "fp32"), ("int8", "fp32"), ("q4", "fp32")],
    *[("int8", "bf16"), ("q4", "bf16"), ("int8", "int8"), ("q4", "int8")],
]


@pytest.fixture(scope="module")
def models(model_dir):
    cfg = load_config(model_dir)
    return {(w, g): load_model(model_dir, cfg, 1024, weights=w, prefill_gemm=g) for w, g in MODELS}


def next_token_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits after every prefix of ``ids`` (one prefill): row i predicts ids[i + 1]."""
    n = len(ids)
    blocks = n // 16 + 1
    kv = model.allocate_kv_cache(blocks, 16)
    meta = AttentionMetadata.build([n], [n], [list(range(blocks))], 16)
    hidden = model(torch.tensor(ids), torch.arange(n), meta, kv)
    return model.compute_logits(hidden).float()


def decode_step_logits(model, ids: list[int]) -> torch.Tensor:
    """The same logits, one decode step (one row, the skinny kernels) per position."""
    n = len(ids)
    blocks = n // 16 + 1
    kv = model.allocate_kv_cache(blocks, 16)
    table = [list(range(blocks))]
    rows = []
    for i in range(n):
        meta = AttentionMetadata.build([1], [i + 1], table, 16)
        hidden = model(torch.tensor(ids[i : i + 1]), torch.tensor([i]), meta, kv)
        rows.append(model.compute_logits(hidden).float())
    return torch.cat(rows)


def perplexity(model, ids: list[int], logits=next_token_logits) -> float:
    logp = torch.log_softmax(logits(model, ids)[:-1], dim=-1)
    return math.exp(-logp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item())


def test_perplexity_of_quantized_weights_stays_near_fp32(models, model_dir):
    ids = Tokenizer(model_dir).encode(TEXT.read_text())
    assert len(ids) > 300
    ppl = {f"{w}/{g}": perplexity(m, ids) for (w, g), m in models.items()}
    assert 5 < ppl["fp32/fp32"] < 40, ppl  # the model reads English
    assert ppl["int8/fp32"] <= ppl["fp32/fp32"] * 1.03, ppl
    assert ppl["q4/fp32"] <= ppl["fp32/fp32"] * 1.08, ppl


def test_perplexity_of_decode_steps_with_int8_activations_stays_near_fp32(models, model_dir):
    ids = Tokenizer(model_dir).encode(TEXT.read_text())
    assert all(models[w, "fp32"].layers[0].mlp.down_proj.skinny_activations == "int8"
               for w in ("int8", "q4"))  # fmt: skip
    ppl = {w: perplexity(models[w, "fp32"], ids, decode_step_logits) for w in ("int8", "q4")}
    ppl["fp32"] = perplexity(models["fp32", "fp32"], ids)
    assert ppl["int8"] <= ppl["fp32"] * 1.03, ppl
    assert ppl["q4"] <= ppl["fp32"] * 1.08, ppl


def test_perplexity_with_bf16_prefill_matmuls_stays_near_fp32(models, model_dir):
    ids = Tokenizer(model_dir).encode(TEXT.read_text())
    assert len(ids) > 300  # one prefill of every token: its matmuls run in bf16
    assert all(models[w, "bf16"].gemm_dtype_for(len(ids)) == "bf16" for w in ("int8", "q4"))
    ppl = {
        f"{w}/{g}": perplexity(models[w, g], ids) for w, g in MODELS if w == "fp32" or g == "bf16"
    }
    assert ppl["int8/bf16"] <= ppl["fp32/fp32"] * 1.03, ppl
    assert ppl["q4/bf16"] <= ppl["fp32/fp32"] * 1.08, ppl


def test_perplexity_with_int8_prefill_matmuls_stays_near_fp32(models, model_dir):
    ids = Tokenizer(model_dir).encode(TEXT.read_text())
    assert all(models[w, "int8"].gemm_dtype_for(len(ids)) == "int8" for w in ("int8", "q4"))
    ppl = {f"{w}/{g}": perplexity(models[w, g], ids) for w, g in MODELS if g in ("fp32", "int8")}
    assert ppl["int8/int8"] <= ppl["fp32/fp32"] * 1.03, ppl
    assert ppl["q4/int8"] <= ppl["fp32/fp32"] * 1.08, ppl


def test_int8_greedy_tokens_agree_with_fp32(models, model_dir):
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine

    tok = Tokenizer(model_dir)
    cfg = load_config(model_dir)
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    engine = LLMEngine(
        EngineConfig(cfg, CacheConfig(16, 256), SchedulerConfig(), 1024),
        models["fp32", "fp32"],
        tok,
    )
    params = SamplingParams(max_tokens=POSITIONS, temperature=0.0, ignore_eos=True)
    agree = {"prefill": 0, "decode": 0}  # decode: one step per position, int8 activations
    for prompt, req in zip(prompts, engine.generate(prompts, params)):
        ref = req.output_token_ids
        for path, logits_of in (("prefill", next_token_logits), ("decode", decode_step_logits)):
            logits = logits_of(models["int8", "fp32"], prompt + ref)[len(prompt) - 1 : -1]
            agree[path] += sum(a == b for a, b in zip(logits.argmax(-1).tolist(), ref))
    total = POSITIONS * len(prompts)
    assert min(agree.values()) >= 0.9 * total, f"{agree} of {total}"
