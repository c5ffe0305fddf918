"""One bad request fails alone (issue 19): a token id past the vocabulary is refused where the
request is admitted (the router, and again each worker), never mid-batch, where it would index
the logits out of bounds and fail every request in the step. The ordinary requests sent with
it get their exact greedy output, token for token against transformers."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine.errors import InvalidRequestError
from engine.request import SamplingParams
from pdserve.client import AsyncClient
from pdserve.cluster.local import ClusterSpec, LocalCluster
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.flow.types import lease_destination
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir
from tests.greedy import assert_same_greedy, hf_greedy

VOCAB = 128
NEW_TOKENS = 12
PROMPTS = [[5, 9, 17, 33], [40, 41, 42], [7] * 9, [100, 3, 64, 12, 90]]
# The case: a stop token id past the vocabulary, with min_tokens (which masks the stop
# ids in the logits, so the bad id indexes them).
BAD_SAMPLING = {"max_tokens": NEW_TOKENS, "min_tokens": 1, "stop_token_ids": [VOCAB + 7]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory.mktemp("isolation"), vocab=VOCAB, seed=5)


def _assert_exact(hf_model, prompts, outputs) -> None:
    for prompt, out in zip(prompts, outputs):
        assert_same_greedy(hf_model, prompt, out, hf_greedy(hf_model, prompt, NEW_TOKENS))


@pytest.mark.parametrize(
    "param, bad",
    [
        ("stop_token_ids", {"min_tokens": 1, "stop_token_ids": (VOCAB + 7,)}),
        ("logit_bias", {"logit_bias": ((VOCAB, 5.0),)}),
        ("prompt", {}),
    ],
)
def test_engine_refuses_a_bad_id_alone_and_its_batch_stays_exact(tiny, make_engine, param, bad):
    path, hf_model = tiny
    engine = make_engine(path)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS[:2]]
    bad_prompt = [5, VOCAB] if param == "prompt" else [5, 6]
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(bad_prompt, SamplingParams(max_tokens=NEW_TOKENS, **bad))
    assert err.value.param == param and str(VOCAB) in str(err.value)
    ids += [engine.add_request(p, params) for p in PROMPTS[2:]]
    while engine.has_unfinished():
        engine.step()
    _assert_exact(hf_model, PROMPTS, [engine.requests.pop(i).output_token_ids for i in ids])


def _bad_decode(stub) -> grpc.RpcError:
    """The bad request sent straight to the decode worker (no lease: it prefills locally, in
    the batch of the ordinary requests), past the router's check."""
    req = pb.DecodeRequest(
        request_id="bad-decode",
        prompt_token_ids=[5, 6, 7],
        sampling=pb.SamplingParams(**BAD_SAMPLING),
    )
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Decode(req, timeout=10))
    return err.value


def _bad_prefill(prefill_stub, decode_stub) -> grpc.RpcError:
    """The bad request sent straight to the prefill worker, toward a real lease."""
    lease = decode_stub.Reserve(pb.ReserveRequest(request_id="bad-prefill", num_tokens=16))
    dest = lease_destination(lease)
    req = pb.PrefillRequest(
        request_id="bad-prefill",
        prompt_token_ids=[5, 6, 7],
        sampling=pb.SamplingParams(**BAD_SAMPLING),
        destination=dest,
    )
    try:
        with pytest.raises(grpc.RpcError) as err:
            list(prefill_stub.Prefill(req, timeout=10))
    finally:
        assert decode_stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id)).released
    return err.value


async def _ordinary_and_bad(cluster, bad_calls):
    """The ordinary requests through the router and the bad ones at the workers, all at once."""
    client = AsyncClient(cluster.address)
    ordinary = [
        client.generate(token_ids=p, max_tokens=NEW_TOKENS, ignore_eos=True) for p in PROMPTS
    ]
    bad = [asyncio.to_thread(call) for call in bad_calls]
    try:
        results = await asyncio.gather(*ordinary, *bad)
    finally:
        await client.close()
    return results[: len(PROMPTS)], results[len(PROMPTS) :]


@pytest.mark.parametrize("local_prefill", [False, True], ids=["disaggregated", "colocated"])
def test_a_bad_request_past_the_router_fails_alone_in_the_workers(tiny, local_prefill):
    path, hf_model = tiny
    # colocated: the ordinary prompts are prefilled on the decode worker too, in one batch
    spec = ClusterSpec(
        model=str(path),
        num_blocks=128,
        max_model_len=64,
        local_prefill_max_tokens=32 * local_prefill,
    )
    with LocalCluster(spec) as cluster:
        decode = pb_grpc.DecodeWorkerStub(grpc.insecure_channel(cluster.decode_addresses[0]))
        prefill = pb_grpc.PrefillWorkerStub(grpc.insecure_channel(cluster.prefill_addresses[0]))
        calls = [lambda: _bad_decode(decode), lambda: _bad_prefill(prefill, decode)]
        outs, errors = asyncio.run(_ordinary_and_bad(cluster, calls))
        for e in errors:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "stop_token_ids" in e.details() and str(VOCAB) in e.details()
        assert [o.finish_reason for o in outs] == ["length"] * len(PROMPTS)
        _assert_exact(hf_model, PROMPTS, [o.token_ids for o in outs])
        assert_all_blocks_free(cluster)


@pytest.mark.parametrize(
    "field, value",
    [("stop_token_ids", [VOCAB + 7]), ("logit_bias", {str(VOCAB): 3.0}), ("prompt", [3, VOCAB])],
)
def test_router_names_the_bad_id_parameter_in_a_400(tiny, field, value):
    from tests.cluster_utils import http_cluster
    from tests.http_utils import post

    body = {"prompt": [3, 4], "max_tokens": 4, "min_tokens": 1, field: value}
    with http_cluster(tiny[0]) as cluster:
        status, payload = post(cluster.http_address, "/v1/completions", body)
        assert status == 400
        assert payload["error"]["param"] == field
        assert str(VOCAB) in payload["error"]["message"]
