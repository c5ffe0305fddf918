"""End to end on the embedded SmolLM2: chat prompts through router -> prefill -> KV over gRPC
-> decode give the single-process engine's greedy tokens and text."""

from __future__ import annotations

import pytest

from engine.request import SamplingParams
from pdserve.cluster.local import ClusterSpec, LocalCluster
from tests.cluster_utils import assert_all_blocks_free, generate_concurrently
from tests.conftest import needs_embedded

pytestmark = [pytest.mark.slow, needs_embedded]

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Why is the sky blue?",
]


def test_chat_through_the_cluster_matches_the_engine(make_engine):
    engine = make_engine("embedded", num_blocks=256)
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    ref = engine.generate(prompts, SamplingParams(max_tokens=32))
    spec = ClusterSpec(model="embedded", num_blocks=256, prefill_chunk_size=32)
    with LocalCluster(spec) as cluster:
        outs = generate_concurrently(
            cluster,
            [
                dict(messages=[{"role": "user", "content": q}], max_tokens=32, include_timings=True)
                for q in QUESTIONS
            ],
        )
        assert_all_blocks_free(cluster)
    for r, o in zip(ref, outs):
        assert o.token_ids == r.output_token_ids
        assert o.text == r.output_text
        assert o.usage.prompt_tokens == r.num_prompt_tokens
        assert o.timings.kv_bytes >= r.num_prompt_tokens * engine.config.model.kv_bytes_per_token
    assert "Paris" in outs[0].text
