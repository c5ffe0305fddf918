"""``pdserve demo``: a handful of concurrent chat requests on the embedded model, with a table.

Runs the engine in this process (colocated prefill and decode) and reports per request: prompt
and output tokens, time to first token, decode speed, and KV bytes the request holds.
"""

from __future__ import annotations

import time

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in one sentence what a GPU is.",
    "Give me three tips for learning to cook.",
    "What does HTTP stand for?",
    "Suggest a name for a friendly robot.",
]


def run_demo(model: str = "embedded", max_tokens: int = 48) -> int:
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    engine = LLMEngine.from_model_path(model)
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=max_tokens)
    ids = [engine.add_request(tok.encode_chat([{"role": "user", "content": q}]), params) for q in DEMO_QUESTIONS]
    reqs = {i: engine.requests[i] for i in ids}
    start = time.monotonic()
    while engine.has_unfinished():
        engine.step()
    wall = time.monotonic() - start
    _print_table(engine, [reqs[i] for i in ids], wall)
    return 0


def _print_table(engine, reqs, wall: float) -> None:
    kv_per_token = engine.config.model.kv_bytes_per_token
    print(f"{'#':>2} {'prompt':>6} {'output':>6} {'TTFT ms':>8} {'tok/s':>6} {'KV MiB':>7}  completion")
    total_out = 0
    for n, r in enumerate(reqs):
        ev = r.events
        ttft = ev["first_token"] - ev["arrived"]
        decode_s = max(ev["finished"] - ev["first_token"], 1e-9)
        n_out = len(r.output_token_ids)
        total_out += n_out
        kv_mib = r.num_tokens * kv_per_token / 2**20
        text = r.output_text.replace("\n", " ")[:60]
        print(f"{n:>2} {r.num_prompt_tokens:>6} {n_out:>6} {ttft * 1e3:>8.0f} "
              f"{(n_out - 1) / decode_s:>6.1f} {kv_mib:>7.2f}  {text}")
    print(f"{len(reqs)} requests, {total_out} tokens in {wall:.2f} s ({total_out / wall:.1f} tok/s)")
