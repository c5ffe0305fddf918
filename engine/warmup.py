"""Warm-up before a worker reports ready: every kernel path of a real step, run once.

A cold process pays one-off costs on its first requests: oneDNN creates (and JIT-compiles) a
primitive per matmul shape, the allocator faults in the pages of the KV blocks and activation
buffers it touches first, the sampler builds its top-k/top-p path, and each C++ kernel (prefill
attention, paged decode attention, the fused decode stack) runs for the first time. A newcomer
sees that as a first request several times slower than the tenth. So each worker runs a small
batch through its own scheduler, runner and sampler before it says it is ready: a long prompt
(the full chunk budget: the prefill matmul shapes), short ones, greedy and sampled, and a few
decode steps at more than one batch size. Afterwards every block is free again and the prefix
cache forgets the synthetic prompts, so what the worker reports is untouched.
"""

from __future__ import annotations

import logging
import time

from engine.request import SamplingParams

log = logging.getLogger("pdserve.engine")

# Decode steps after the prefills: enough to run the decode path at batch sizes 4, 3, 2 and 1.
WARMUP_DECODE_STEPS = 4


def warmup_prompts(engine) -> list[list[int]]:
    """Synthetic prompts: one as long as a whole chunk budget (capped below the context), and
    three short ones of different lengths (short prefills and a mixed batch); only as many as
    the KV pool holds at once, so a small test pool never waits on itself."""
    cfg = engine.config
    steps = WARMUP_DECODE_STEPS
    long_len = min(cfg.scheduler.max_num_batched_tokens, cfg.max_model_len - steps - 2)
    lengths = [n for n in (long_len, 37, 9, 1) if 0 < n <= long_len]
    blocks, prompts = engine.blocks, []
    free = blocks.num_total
    for i, n in enumerate(lengths):
        need = blocks.blocks_needed(n + steps)
        if need > free:
            continue
        free -= need
        # Deterministic ids spread over the vocabulary.
        prompts.append([(7919 * (i + 1) + 104729 * j) % cfg.model.vocab_size for j in range(n)])
    return prompts


def warm_up(engine) -> float:
    """Run the warm-up batch through ``engine``'s own step loop; returns the seconds it took.

    Call before the worker's engine thread starts (nothing else may use the scheduler)."""
    start = time.perf_counter()
    prompts = warmup_prompts(engine)
    greedy = SamplingParams(max_tokens=WARMUP_DECODE_STEPS, ignore_eos=True)
    sampled = SamplingParams(
        max_tokens=WARMUP_DECODE_STEPS,
        temperature=0.8,
        top_k=40,
        top_p=0.9,
        seed=0,
        ignore_eos=True,
    )
    ids = [
        engine.add_request(p, sampled if i % 2 else greedy, request_id=f"warmup-{i}")
        for i, p in enumerate(prompts)
    ]
    while engine.has_unfinished():
        engine.step()
    for request_id in ids:
        engine.requests.pop(request_id, None)
    blocks = engine.blocks
    if blocks.num_free != blocks.num_total:
        raise RuntimeError(f"warm-up left {blocks.num_total - blocks.num_free} blocks in use")
    blocks.reset_prefix_cache()
    seconds = time.perf_counter() - start
    log.info(
        "warm-up: %d prompts, %d decode steps in %.2f s", len(prompts), WARMUP_DECODE_STEPS, seconds
    )
    return seconds
