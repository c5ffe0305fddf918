"""``prefill_layerwise_kv: false``: the prefill worker sends a chunk's KV after the chunk's
whole forward instead of layer by layer (what `pdserve bench netns-cluster link` compares
layer-wise streaming against). Output stays exact; no frame leaves before the last layer."""

from __future__ import annotations

import threading

import pytest

from pdserve.cluster.local import ClusterSpec, LocalCluster
from tests.cluster_utils import assert_all_blocks_free, generate_concurrently
from tests.conftest import tiny_llama_dir
from tests.test_disagg import engine_reference, mixed_prompts

NUM_LAYERS = 3


@pytest.mark.parametrize("transport", ["grpc", "local"])
def test_kv_after_the_forward_is_exact_and_sent_after_the_last_layer(tmp_path, transport):
    model, _ = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2, layers=NUM_LAYERS, seed=3)
    prompts = [list(range(3, 83)), *mixed_prompts(6, seed=2)]  # the first: 5 chunks of 16
    spec = ClusterSpec(
        model=str(model),
        kv_transport=transport,
        num_blocks=512,
        max_model_len=256,
        prefill_chunk_size=16,
        prefill_layerwise_kv=False,
    )
    with LocalCluster(spec) as cluster:
        order: list[str] = []
        received = threading.Event()
        cluster.decode_workers[0].receiver.on_event = lambda kind, lease, layer: (
            order.append(f"recv {kind} {layer}"),
            received.set(),
        )

        def on_layer(layer, ids):
            if not order:  # the first layer: layer-wise, its frames would arrive meanwhile
                received.wait(2.0)
            order.append(f"computed {layer}")

        cluster.prefill_workers[0].on_layer_computed = on_layer
        [first] = generate_concurrently(
            cluster, [dict(token_ids=prompts[0], max_tokens=4, ignore_eos=True)]
        )
        outs = generate_concurrently(
            cluster, [dict(token_ids=p, max_tokens=12, ignore_eos=True) for p in prompts[1:]]
        )
        assert_all_blocks_free(cluster)
    assert first.token_ids == engine_reference(model, prompts[:1], new_tokens=4)[0]
    assert [o.token_ids for o in outs] == engine_reference(model, prompts[1:])
    # The first chunk's frames leave with its last layer (the hook runs after the sends), not
    # while layer 0 waited 2 s for them.
    first_recv = next(i for i, e in enumerate(order) if e.startswith("recv kv"))
    computed = [f"computed {i}" for i in range(NUM_LAYERS - 1)]
    assert order[: NUM_LAYERS - 1] == computed and first_recv >= NUM_LAYERS - 1, order
