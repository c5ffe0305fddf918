"""Malformed Reserve / KV commit / Decode sequences sent straight at a decode worker over gRPC
(issue 46): each is refused with its own status code, nothing decodes on KV that did not
arrive, no block is lost, and the worker keeps serving a normal request exactly.

Codes: bad input is INVALID_ARGUMENT (tokens outside the vocabulary, a prompt that does not
fit the lease or the context, forks that do not match n, a Reserve out of range); a wrong
state is FAILED_PRECONDITION (a lease a Decode attached already, a lease whose commit was
refused). A lease the worker does not know (never reserved, expired, released) stays
NOT_FOUND and KV that never came DEADLINE_EXCEEDED: the router reads both as "lease gone"
and reserves again (router/flow/types.py LEASE_GONE_CODES). A refused commit is answered in
the push's ack; the Decode on its lease gets FAILED_PRECONDITION at the lease's deadline (the
router, told by the sender's failed transfer, has cancelled it by then).
"""

from __future__ import annotations

import collections
import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kv_transfer.frame import encode_commit_frame, encode_kv_frame
from pdserve.cluster.local import ClusterSpec, LocalCluster
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from tests.cluster_utils import assert_all_blocks_free, generate_concurrently
from tests.conftest import tiny_llama_dir
from tests.test_disagg import engine_reference, mixed_prompts

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

BS, HEADS, HEAD_DIM, LAYERS, VOCAB, CONTEXT = 16, 2, 16, 2, 128, 128
LEASE_S = 0.5  # a Decode whose KV never completes waits this long
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("decode-fuzz"), num_kv_heads=HEADS, seed=9)
    return path


@pytest.fixture(scope="module")
def cluster(tiny_model):
    spec = ClusterSpec(model=str(tiny_model), num_blocks=96, max_model_len=CONTEXT)
    with LocalCluster(spec) as c:
        yield c


class Decoder:
    """One decode worker's API and KV port (gRPC KV: the same address)."""

    def __init__(self, cluster: LocalCluster):
        self.channel = grpc.insecure_channel(cluster.decode_addresses[0])
        self.stub = pb_grpc.DecodeWorkerStub(self.channel)
        self.kv = pb_grpc.KvTransferStub(self.channel)
        self.names = iter(range(1_000_000))

    def reserve(self, tokens: int, **kw) -> pb.ReserveResponse:
        kw.setdefault("request_id", f"r{next(self.names)}")
        kw.setdefault("lease_seconds", LEASE_S)
        return self.stub.Reserve(pb.ReserveRequest(num_tokens=tokens, **kw), timeout=5)

    def push(self, lease, cells: dict[int, list[int]], commit: int | None = None) -> pb.PushAck:
        """One kv frame per layer in ``cells`` (its block positions), then a commit that
        counts ``commit`` frames (the number sent when None)."""
        rid, lid = _ids(lease)
        frames = [
            encode_kv_frame(rid, lid, layer, blocks, torch.randn(2, len(blocks), BS, HEADS, 16))
            for layer, blocks in cells.items()
        ]
        frames.append(encode_commit_frame(rid, lid, len(frames) if commit is None else commit))
        messages = (pb.KvFrame(header=h, payload=bytes(p)) for h, p in frames)
        return self.kv.PushFrames(messages, timeout=10)

    def push_all(self, lease) -> pb.PushAck:
        ack = self.push(lease, {layer: list(range(len(lease.block_ids))) for layer in range(2)})
        assert not ack.errors, ack
        return ack

    def decode(
        self, lease, prompt_len: int, max_tokens: int = 2, timeout: float = 10, **kw
    ) -> tuple[Code, str]:
        """The Decode call's end: (OK, "") once it streamed every token, else its error."""
        rid, lid = _ids(lease)
        req = pb.DecodeRequest(
            request_id=kw.pop("request_id", f"d-{rid}"),
            lease_id=lid,
            prompt_token_ids=kw.pop("prompt", [5] * prompt_len),
            output_token_ids=kw.pop("outputs", [6]),
            sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw),
        )
        try:
            chunks = list(self.stub.Decode(req, timeout=timeout))
        except grpc.RpcError as e:
            return e.code(), e.details()
        tokens = sum(len(c.token_ids) for c in chunks if c.index == 0)
        assert tokens == max_tokens - 1 and chunks[-1].finish_reason == "length"
        return Code.OK, ""

    def status(self) -> pb.WorkerStatus:
        return self.stub.Status(pb.StatusRequest(), timeout=5)


def _ids(lease) -> tuple[str, str]:
    if isinstance(lease, str):  # a lease id the worker never gave
        return "nobody", lease
    return lease.request_id, lease.lease_id


class _Lease:
    """A ReserveResponse with the request id it was reserved under (frames must name it)."""

    def __init__(self, resp: pb.ReserveResponse, request_id: str):
        self.lease_id, self.block_ids, self.request_id = resp.lease_id, resp.block_ids, request_id


def reserve(d: Decoder, tokens: int = 40, **kw) -> _Lease:
    rid = f"r{next(d.names)}"
    return _Lease(d.reserve(tokens, request_id=rid, **kw), rid)


def reserve_code(d: Decoder, tokens: int, **kw) -> Code:
    try:
        d.reserve(tokens, **kw)
    except grpc.RpcError as e:
        return e.code()
    return Code.OK


def assert_serves_exactly(cluster, tiny_model) -> None:
    prompts = [p[:40] for p in mixed_prompts(2, seed=46)]
    reference = engine_reference(tiny_model, prompts, new_tokens=6)
    outs = generate_concurrently(
        cluster, [{"token_ids": p, "max_tokens": 6, "ignore_eos": True} for p in prompts]
    )
    assert [o.token_ids for o in outs] == reference
    assert cluster.router.decode.routable()  # never taken out of routing
    health = health_pb2_grpc.HealthStub(Decoder(cluster).channel).Check(
        health_pb2.HealthCheckRequest(), timeout=5
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert_all_blocks_free(cluster)


def test_incomplete_commits_are_refused_and_their_decode_never_runs(cluster, tiny_model):
    d = Decoder(cluster)
    cases = {  # name: (frames by layer, the commit's count) for a lease of 3 blocks
        "zero frames then commit": ({}, 0),
        "one layer of two": ({0: [0, 1, 2]}, 1),
        "a block missing": ({0: [0, 1], 1: [0, 1]}, 2),
        "a layer past the model": ({0: [0, 1, 2], LAYERS: [0, 1, 2], 1: [0, 1, 2]}, 3),
    }
    for name, (cells, count) in cases.items():
        lease = reserve(d)
        ack = d.push(lease, cells, commit=count)
        why = "out of range" if name == "a layer past the model" else "incomplete commit"
        assert any(why in e for e in ack.errors), (name, ack)
        if name == "a layer past the model":
            assert any("expected 3 frames, got 2" in e for e in ack.errors), ack
        late = d.push(lease, {0: [0]})  # a refused commit is final
        assert any("commit refused" in e for e in late.errors), (name, late)
        code, details = d.decode(lease, 40)
        assert code == Code.FAILED_PRECONDITION, (name, code, details)
    # The Decode waits for the KV, and the incomplete commit ends it.
    lease = reserve(d)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(d.decode, lease, 40)
        time.sleep(0.1)
        assert "incomplete commit" in d.push(lease, {1: [0, 1, 2]}).errors[0]
        code, details = waiting.result(timeout=10)
    assert code == Code.FAILED_PRECONDITION and "incomplete commit" in details
    assert_serves_exactly(cluster, tiny_model)


def test_bad_decodes_are_invalid_argument_and_give_the_lease_back(cluster, tiny_model):
    d = Decoder(cluster)
    cases = {  # name: the Decode's fields, on a fully committed lease of 40 tokens (3 blocks)
        "prompt longer than the lease": {"prompt_len": 60},
        "prompt shorter than the lease": {"prompt_len": 20},
        "prompt past the context": {"prompt_len": CONTEXT + 1},
        "prompt token past the vocabulary": {"prompt_len": 0, "prompt": [5] * 39 + [VOCAB]},
        "first token past the vocabulary": {"prompt_len": 40, "outputs": [VOCAB + 7]},
        "no first token": {"prompt_len": 40, "outputs": []},
        "fork token past the vocabulary": {"prompt_len": 40, "n": 2, "temperature": 1.0},
        "forks that do not match n": {"prompt_len": 40, "n": 3, "temperature": 1.0},
    }
    forks = {"fork token past the vocabulary": [VOCAB], "forks that do not match n": [7]}
    for name, fields in cases.items():
        lease = reserve(d)
        d.push_all(lease)
        before = d.status().num_leases
        if name in forks:
            code, details = _decode_with_forks(d, lease, forks[name], **fields)
        else:
            code, details = d.decode(lease, **fields)
        assert code == Code.INVALID_ARGUMENT, (name, code, details)
        assert d.status().num_leases == before - 1, name  # released at once, not at expiry
    assert_serves_exactly(cluster, tiny_model)


def _decode_with_forks(d: Decoder, lease, forks, prompt_len, **sampling):
    req = pb.DecodeRequest(
        request_id=f"f-{lease.request_id}",
        lease_id=lease.lease_id,
        prompt_token_ids=[5] * prompt_len,
        output_token_ids=[6],
        sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True, **sampling),
        fork_token_ids=forks,
    )
    try:
        list(d.stub.Decode(req, timeout=10))
    except grpc.RpcError as e:
        return e.code(), e.details()
    return Code.OK, ""


def test_double_attach_and_unknown_leases(cluster, tiny_model, monkeypatch):
    d = Decoder(cluster)
    lease = reserve(d)
    d.push_all(lease)
    assert d.decode(lease, 40) == (Code.OK, "")
    code, details = d.decode(lease, 40)  # the same lease again
    assert code == Code.FAILED_PRECONDITION and "attached already" in details
    assert reserve_code(d, 8, lease_id=lease.lease_id) == Code.INVALID_ARGUMENT  # id reused
    # Two Decodes wait on one lease: the first to attach takes it, the other is refused.
    lease = reserve(d)
    with ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(d.decode, lease, 40, request_id=f"twin{i}") for i in range(2)]
        time.sleep(0.1)
        d.push_all(lease)
        codes = sorted((c.result(timeout=10)[0] for c in calls), key=str)
    assert codes == sorted([Code.OK, Code.FAILED_PRECONDITION], key=str)
    # One request id decoding twice at once, on two leases (the first one's steps slowed, so
    # it is surely still running when the second arrives).
    first, second = reserve(d), reserve(d)
    d.push_all(first)
    d.push_all(second)
    (worker,) = cluster.decode_workers
    monkeypatch.setattr(worker, "before_schedule", _slowly(worker.before_schedule))
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(d.decode, first, 40, max_tokens=40, request_id="same")
        deadline = time.monotonic() + 10
        while not (st_ := d.status()).num_running + st_.num_waiting:  # until it attached
            assert time.monotonic() < deadline
            time.sleep(0.01)
        code, details = d.decode(second, 40, request_id="same")
        assert running.result(timeout=30) == (Code.OK, "")
    monkeypatch.undo()
    assert code == Code.FAILED_PRECONDITION and "decoding already" in details
    # Leases the worker does not know: the router's "lease gone" (it reserves again).
    ack = d.push("no-such-lease", {}, commit=0)
    assert ack.frames_accepted == 0 and "unknown lease" in ack.errors[0]
    assert d.decode("no-such-lease", 40)[0] == Code.NOT_FOUND
    assert_serves_exactly(cluster, tiny_model)


def _slowly(step_hook):
    def slow():
        time.sleep(0.02)
        step_hook()

    return slow


def test_bad_reserves_are_invalid_argument(cluster):
    d = Decoder(cluster)
    for name, tokens, kw in [
        ("no tokens", 0, {}),
        ("past the context", CONTEXT, {}),
        ("a lease id too long", 8, {"lease_id": "x" * 300}),
        ("an empty request id", 8, {"request_id": ""}),
        ("a negative lease", 8, {"lease_seconds": -1.0}),
        ("a NaN lease", 8, {"lease_seconds": float("nan")}),
    ]:
        assert reserve_code(d, tokens, **kw) == Code.INVALID_ARGUMENT, name
    st_ = d.status()
    assert st_.num_leases == 0 and st_.num_free_blocks == st_.num_total_blocks


# ---- random sequences ------------------------------------------------------------------
REFUSALS = {Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION, Code.NOT_FOUND, Code.DEADLINE_EXCEEDED}


def test_random_sequences_never_decode_stale_kv_or_lose_a_block(cluster, tiny_model):
    """Seeded random Reserve / frames / commit / Decode / Release sequences: every call ends
    OK or with a refusal code, a Decode streams only on a lease whose commit covered every
    layer x block, and every block comes back. A Decode whose KV is not all in waits: the
    client gives up on it after 0.3 s (DEADLINE_EXCEEDED, its own), which releases the
    lease, as the router's cancel does."""
    rng, d = random.Random(46), Decoder(cluster)
    seen: collections.Counter = collections.Counter()
    for _ in range(40):
        sizes = [rng.randint(1, 70) for _ in range(rng.randint(1, 3))]
        leases = [(reserve(d, n, lease_seconds=5.0), n) for n in sizes]  # (lease, tokens)
        complete: set[str] = set()  # leases whose commit was accepted
        for _ in range(rng.randint(2, 6)):
            op = rng.choice(
                ["frames", "complete", "complete", "decode", "decode", "decode", "release"]
            )
            lease, tokens = rng.choice(leases)
            if op in ("frames", "complete"):
                if _push_random(d, rng, lease, full=op == "complete"):
                    complete.add(lease.lease_id)
            elif op == "decode":
                prompt_len = tokens + rng.choice([0, 0, 0, -20, -1, 1, 20])
                first = rng.choice([6, 6, 6, VOCAB])
                code, details = d.decode(lease, max(0, prompt_len), outputs=[first], timeout=0.3)
                assert code == Code.OK or code in REFUSALS, (code, details)
                assert code != Code.OK or lease.lease_id in complete  # never on stale KV
                seen[code] += 1
            else:
                d.stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id), timeout=5)
        for lease, _ in leases:
            d.stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id), timeout=5)
    assert set(seen) == REFUSALS | {Code.OK}, seen  # every outcome was met
    assert_serves_exactly(cluster, tiny_model)


def _push_random(d: Decoder, rng: random.Random, lease: _Lease, full: bool) -> bool:
    """Frames for some layers (one past the model now and then) x some leading blocks, and a
    commit that may miscount; True when the worker accepted it all (then it was complete)."""
    n = len(lease.block_ids)
    layers = list(range(LAYERS)) if full else rng.sample(range(LAYERS + 1), rng.randint(0, 3))
    blocks = list(range(n if full else rng.randint(0, n)))
    cells = {layer: blocks for layer in layers} if blocks else {}
    off = 0 if full else rng.choice([-1, 0, 0, 1])
    ack = d.push(lease, cells, commit=max(0, len(cells) + off))
    if ack.errors:
        return False
    assert set(cells) == set(range(LAYERS)) and len(blocks) == n and off == 0, (cells, ack)
    return True


def test_a_commit_covers_every_layer_and_block_the_lease_promised():
    """The receiver's own check: a table that knows its layers refuses a commit that leaves a
    cell empty; one without (a bare transport) counts frames only, as before."""
    from kv_transfer.errors import FrameError
    from kv_transfer.lease import LeaseTable
    from kv_transfer.receiver import KVReceiver

    cache = [(torch.zeros(8, BS, HEADS, 16), torch.zeros(8, BS, HEADS, 16)) for _ in range(2)]
    rx = KVReceiver(cache, LeaseTable(30.0, num_layers=2), pending_lease_wait_s=0.1)
    lease = rx.leases.open("r", [3, 4])
    kv = torch.randn(2, 2, BS, HEADS, 16)
    rx.accept(*encode_kv_frame("r", lease.lease_id, 0, [0, 1], kv))
    rx.accept(*encode_kv_frame("r", lease.lease_id, 1, [1], kv[:, :1].contiguous()))
    rx.accept(*encode_kv_frame("r", lease.lease_id, 1, [1], kv[:, :1].contiguous()))  # again
    with pytest.raises(
        FrameError, match=r"1 of 2 x 2 \(layer x block\) cells have no KV .*layer 1"
    ):
        rx.accept(*encode_commit_frame("r", lease.lease_id, 3))
    assert not lease.is_committed and lease.commit_refused
    bare = KVReceiver(cache, LeaseTable(30.0), pending_lease_wait_s=0.1)
    other = bare.leases.open("r", [5, 6])
    bare.accept(*encode_commit_frame("r", other.lease_id, 0))
    assert other.is_committed
