"""Request lifecycle edges in the disaggregated path: preemption through the router, lease
expiry, bad KV frames against a live worker, clients that leave. Blocks always come back."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from kv_transfer.frame import encode_kv_frame
from pdserve.client import AsyncClient, Client
from pdserve.cluster.local import ClusterSpec, LocalCluster
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from tests.cluster_utils import assert_all_blocks_free, generate_concurrently, worker_statuses
from tests.conftest import tiny_llama_dir
from tests.test_disagg import engine_reference, mixed_prompts


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(
        tmp_path_factory.mktemp("lifecycle"), num_heads=4, num_kv_heads=2, seed=11
    )
    return path


def test_decode_preemption_goes_back_through_the_router(tiny_model):
    """A decode pool too small for every sequence at full length preempts; the router
    re-prefills the victims with their generated tokens and outputs stay exact."""
    prompts = mixed_prompts(8, seed=8)
    prompts = [p[:12] for p in prompts]
    new_tokens = 40
    ref = engine_reference(tiny_model, prompts, new_tokens=new_tokens, block_size=4)
    spec = ClusterSpec(
        model=str(tiny_model), block_size=4, num_blocks=512, decode_num_blocks=48, max_model_len=128
    )
    with LocalCluster(spec) as cluster:
        outs = generate_concurrently(
            cluster, [dict(token_ids=p, max_tokens=new_tokens, ignore_eos=True) for p in prompts]
        )
        assert_all_blocks_free(cluster)
        decode = [s for s in worker_statuses(cluster) if s.role == "decode"][0]
    assert decode.num_preemptions > 0
    assert [o.token_ids for o in outs] == ref


def _decode_stub(cluster):
    return pb_grpc.DecodeWorkerStub(grpc.insecure_channel(cluster.decode_addresses[0]))


def test_unused_lease_expires_and_frees_its_blocks(tiny_model):
    spec = ClusterSpec(model=str(tiny_model), num_blocks=64, max_model_len=128)
    with LocalCluster(spec) as cluster:
        stub = _decode_stub(cluster)
        lease = stub.Reserve(pb.ReserveRequest(request_id="r1", num_tokens=40, lease_seconds=0.3))
        assert len(lease.block_ids) == 3
        st = stub.Status(pb.StatusRequest())
        assert st.num_free_blocks == 61 and st.num_leases == 1
        assert_all_blocks_free(cluster, timeout=5)  # the engine loop expires it


def test_committed_lease_nobody_attaches_expires_and_frees_its_blocks(tiny_model):
    """Every frame in, then the router (or its client) is gone before Decode: the committed
    lease has a deadline too, and the engine loop gives its blocks back."""
    import torch

    from kv_transfer.frame import encode_commit_frame

    spec = ClusterSpec(model=str(tiny_model), num_blocks=64, max_model_len=128)
    with LocalCluster(spec) as cluster:
        stub = _decode_stub(cluster)
        lease = stub.Reserve(pb.ReserveRequest(request_id="r1", num_tokens=40, lease_seconds=0.5))
        kv_stub = pb_grpc.KvTransferStub(grpc.insecure_channel(cluster.decode_addresses[0]))
        kv = torch.zeros(2, len(lease.block_ids), 16, 2, 16)  # every block of both layers
        frames = [encode_kv_frame("r1", lease.lease_id, layer, range(3), kv) for layer in (0, 1)]
        frames.append(encode_commit_frame("r1", lease.lease_id, 2))
        ack = kv_stub.PushFrames(pb.KvFrame(header=h, payload=bytes(p)) for h, p in frames)
        assert ack.frames_accepted == 3 and not ack.errors
        assert stub.Status(pb.StatusRequest()).num_leases == 1
        assert_all_blocks_free(cluster, timeout=5)
        assert stub.Status(pb.StatusRequest()).num_leases == 0
        # A late Decode for it fails cleanly instead of decoding on freed blocks.
        late = pb.DecodeRequest(
            request_id="r1", lease_id=lease.lease_id, prompt_token_ids=[5] * 39,
            output_token_ids=[6],
        )  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Decode(late))
        assert err.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_released_lease_frees_its_blocks_at_once(tiny_model):
    with LocalCluster(
        ClusterSpec(model=str(tiny_model), num_blocks=64, max_model_len=128)
    ) as cluster:
        stub = _decode_stub(cluster)
        lease = stub.Reserve(pb.ReserveRequest(request_id="r1", num_tokens=40))
        assert stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id)).released
        assert not stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id)).released
        st = stub.Status(pb.StatusRequest())
        assert st.num_free_blocks == st.num_total_blocks and st.num_leases == 0


def test_bad_frames_are_rejected_and_the_worker_keeps_serving(tiny_model):
    import torch

    with LocalCluster(
        ClusterSpec(model=str(tiny_model), num_blocks=64, max_model_len=128)
    ) as cluster:
        stub = _decode_stub(cluster)
        lease = stub.Reserve(pb.ReserveRequest(request_id="r1", num_tokens=8))
        good_shape = (2, 1, 16, 2, 16)
        frames = [
            encode_kv_frame("r1", "no-such-lease", 0, [0], torch.zeros(good_shape)),
            encode_kv_frame("r1", lease.lease_id, 0, [0], torch.zeros(2, 1, 8, 2, 16)),
            encode_kv_frame("r1", lease.lease_id, 99, [0], torch.zeros(good_shape)),
            (b"\x93garbage", b""),
        ]
        header, payload = encode_kv_frame("r1", lease.lease_id, 0, [0], torch.zeros(good_shape))
        frames.append((header, bytes(payload)[:-4] + b"\x00\x00\x00\x01"))  # checksum mismatch
        kv_stub = pb_grpc.KvTransferStub(grpc.insecure_channel(cluster.decode_addresses[0]))
        ack = kv_stub.PushFrames(iter([pb.KvFrame(header=h, payload=bytes(p)) for h, p in frames]))
        assert ack.frames_rejected == len(frames) and ack.frames_accepted == 0
        reasons = " | ".join(ack.errors)
        for word in ("unknown lease", "shape", "layer", "checksum"):
            assert word in reasons, reasons
        stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id))
        [out] = generate_concurrently(
            cluster, [dict(token_ids=[5, 6, 7], max_tokens=5, ignore_eos=True)]
        )
        assert len(out.token_ids) == 5
        assert stub.Status(pb.StatusRequest()).frames_rejected >= len(frames)
        assert_all_blocks_free(cluster)


def test_client_that_leaves_mid_stream_frees_everything(tiny_model):
    with LocalCluster(
        ClusterSpec(model=str(tiny_model), num_blocks=128, max_model_len=256)
    ) as cluster:

        async def leave_early():
            client = AsyncClient(cluster.address)
            got = 0
            async for _ in client.stream(token_ids=[5, 6, 7], max_tokens=200, ignore_eos=True):
                got += 1
                if got == 3:
                    break
            await client.close()
            return got

        assert asyncio.run(leave_early()) == 3
        time.sleep(0.2)
        assert_all_blocks_free(cluster)


def test_reservation_under_a_caller_chosen_lease_id(tiny_model):
    """The router names the lease so it can prefill toward it before Reserve answers; a name in
    use is refused by name, and a reservation that fails tells frames waiting for it."""
    from kv_transfer.errors import FrameError

    with LocalCluster(
        ClusterSpec(model=str(tiny_model), num_blocks=64, max_model_len=128)
    ) as cluster:
        stub = _decode_stub(cluster)
        st = stub.Status(pb.StatusRequest())
        assert st.block_size == 16 and st.kv_endpoint and st.kv_transport
        lease = stub.Reserve(pb.ReserveRequest(request_id="r1", num_tokens=40, lease_id="mine"))
        assert lease.lease_id == "mine" and len(lease.block_ids) == 3
        with pytest.raises(grpc.RpcError) as err:
            stub.Reserve(pb.ReserveRequest(request_id="r2", num_tokens=8, lease_id="mine"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "lease_id" in err.value.details()
        for i in range(7):  # 3 + 7 x 8 = 59 of 64 blocks
            stub.Reserve(pb.ReserveRequest(request_id=f"f{i}", num_tokens=120))
        with pytest.raises(grpc.RpcError) as err:
            stub.Reserve(pb.ReserveRequest(request_id="r3", num_tokens=120, lease_id="late"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(FrameError, match="refused: need 8 blocks, 5 free"):
            cluster.decode_workers[0].leases.wait_for("late", timeout=5)


def test_prefill_refuses_a_destination_too_small_by_name(tiny_model):
    with LocalCluster(
        ClusterSpec(model=str(tiny_model), num_blocks=64, max_model_len=128)
    ) as cluster:
        st = _decode_stub(cluster).Status(pb.StatusRequest())
        channel = grpc.insecure_channel(cluster.prefill_addresses[0])
        dest = pb.KvDestination(
            endpoint=st.kv_endpoint,
            transport=st.kv_transport,
            lease_id="l",
            block_size=16,
            num_blocks=1,
        )
        call = pb_grpc.PrefillWorkerStub(channel).Prefill(
            pb.PrefillRequest(request_id="r", prompt_token_ids=[5] * 20, destination=dest)
        )
        with pytest.raises(grpc.RpcError) as err:
            next(call)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "destination.num_blocks" in err.value.details()
        assert_all_blocks_free(cluster)


def _count_named_reservations(decode, refuse: bool) -> list[str]:
    """Wrap the decode worker's reserve: record caller-named (concurrent) reservations, and
    refuse them all if asked, as a pool that filled up since the router's last poll would."""
    from decode_worker.worker import ReservationError

    real, named = decode.reserve, []

    def reserve(request_id, num_tokens, ttl_s=None, lease_id=None, block_hashes=()):
        if lease_id is not None:
            named.append(lease_id)
            if refuse:
                decode.leases.refuse(lease_id, "pretend the pool filled up")
                raise ReservationError("pretend the pool filled up")
        return real(request_id, num_tokens, ttl_s, lease_id, block_hashes)

    decode.reserve = reserve
    return named


def test_first_token_does_not_wait_for_the_concurrent_reservation(tiny_model):
    """The router sends Reserve beside Prefill and lets the first token go once sampled: here
    the decode worker answers Reserve only after the client holds that token."""
    prompt = mixed_prompts(1, seed=9)[0]
    ref = engine_reference(tiny_model, [prompt], new_tokens=12)[0]
    first_token_seen = threading.Event()
    with LocalCluster(
        ClusterSpec(model=str(tiny_model), num_blocks=512, max_model_len=256)
    ) as cluster:
        decode = cluster.decode_workers[0]
        real, answered_after_first_token = decode.reserve, []

        def reserve(request_id, num_tokens, ttl_s=None, lease_id=None, block_hashes=()):
            # A router that waited for this answer would never send the token: 30 s, then False.
            answered_after_first_token.append(first_token_seen.wait(timeout=30))
            return real(request_id, num_tokens, ttl_s, lease_id, block_hashes)

        decode.reserve = reserve
        tokens = []
        with Client(cluster.address) as client:
            for chunk in client.stream(token_ids=prompt, max_tokens=12, ignore_eos=True):
                first_token_seen.set()
                tokens += chunk.token_ids
        assert_all_blocks_free(cluster)
    assert answered_after_first_token == [True]
    assert tokens == ref


@pytest.mark.parametrize("refuse", [False, True], ids=["granted", "refused"])
def test_concurrent_reservation_outputs_stay_exact(tiny_model, refuse):
    """With room at the decode worker the router reserves and prefills at once; a refused
    reservation drops that prefill and the request goes again, reserving first."""
    prompts = mixed_prompts(6, seed=5)
    ref = engine_reference(tiny_model, prompts)
    with LocalCluster(
        ClusterSpec(model=str(tiny_model), num_blocks=512, max_model_len=256)
    ) as cluster:
        named = _count_named_reservations(cluster.decode_workers[0], refuse)
        outs = generate_concurrently(
            cluster, [dict(token_ids=p, max_tokens=12, ignore_eos=True) for p in prompts]
        )
        assert_all_blocks_free(cluster)
    assert len(named) == len(prompts)  # every request tried the concurrent path first
    assert [o.token_ids for o in outs] == ref
