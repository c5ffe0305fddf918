"""KV-aware routing: the router follows each worker's prefix cache (block hashes stored and
evicted, by status-poll deltas), routes a chat's next turn to the decode worker that holds its
history, and lets that worker prefill the short tail itself: no prefill, no KV shipped. Greedy
outputs stay the single-process engine's, token for token, whatever the router's picture."""

from __future__ import annotations

import signal

import pytest
import torch

from engine.block_manager import BlockManager, prefix_block_hashes
from engine.kv_events import KvEventLog
from pdserve.cluster.local import ClusterSpec, LocalCluster
from protos import pdserve_pb2 as pb
from router.kv_index import HeldBlocks
from router.policies import KV_MISSING_BLOCK_WEIGHT, kv_aware_decode, kv_aware_prefill
from tests.cluster_utils import assert_all_blocks_free, generate_concurrently
from tests.conftest import tiny_llama_dir
from tests.test_disagg import engine_reference
from tests.transport_params import transport_params

BS = 16
NEW_TOKENS = 12
TURNS = 4


# ---- the event log and the router's index -------------------------------------------------
def _apply(held: HeldBlocks, delta) -> None:
    held.apply(
        pb.KvCacheEvents(
            epoch=delta.epoch,
            seq=delta.seq,
            full=delta.full,
            stored=delta.stored,
            removed=delta.removed,
        )
    )


def test_router_index_follows_the_cache_through_deltas_evictions_and_resets():
    bm = BlockManager(num_blocks=4, block_size=2)
    held = HeldBlocks()
    tokens = [5, 6, 7, 8, 9, 10]
    table = bm.allocate(3)
    bm.cache_full_blocks(table, [], tokens, 6)
    _apply(held, bm.kv_events_since(held.epoch, held.seq))  # first poll: the whole set
    hashes = prefix_block_hashes(tokens, 2)
    assert held.cached_blocks(hashes) == 3
    bm.free(table)
    _apply(held, bm.kv_events_since(held.epoch, held.seq))  # freed blocks stay cached
    assert held.cached_blocks(hashes) == 3
    bm.allocate(2)  # takes the free block, then the oldest cached one: evicts block 2's tail
    delta = bm.kv_events_since(held.epoch, held.seq)
    assert not delta.full and len(delta.removed) == 1
    _apply(held, delta)
    assert held.hashes == set(bm._block_of_hash)
    bm.reset_prefix_cache()  # a new epoch: the router resyncs from the whole (empty) set
    delta = bm.kv_events_since(held.epoch, held.seq)
    assert delta.full
    _apply(held, delta)
    assert held.cached_blocks(hashes) == 0


def test_event_log_nets_out_and_sends_the_whole_set_when_the_reader_fell_behind():
    log = KvEventLog(max_events=4)
    log.stored(b"a")
    log.stored(b"b")
    log.removed(b"a")
    delta = log.since(log.epoch, 0, held=[b"b"])
    assert (delta.full, delta.stored, delta.removed) == (False, [b"b"], [b"a"])
    for h in (b"c", b"d", b"e"):
        log.stored(h)
    behind = log.since(log.epoch, 1, held=[b"b", b"c", b"d", b"e"])  # event 2 was dropped
    assert behind.full and set(behind.stored) == {b"b", b"c", b"d", b"e"}
    assert log.since(log.epoch + 1, log.seq, held=[]).full  # another epoch: resync


class _Worker:
    def __init__(self, name, free, total, hashes=(), inflight_tokens=0):
        self.address, self.free_blocks, self.total_blocks = name, free, total
        self.inflight_tokens, self.inflight_requests = inflight_tokens, 0
        self.kv = HeldBlocks()
        self.kv.hashes = set(hashes)

    def has_stream_room(self):
        return True


def test_kv_aware_policies_weigh_what_a_worker_holds_against_its_load():
    hashes = [bytes([i]) * 16 for i in range(10)]
    w = KV_MISSING_BLOCK_WEIGHT
    holder = _Worker("holder", free=80, total=100, hashes=hashes[:8])
    idle = _Worker("idle", free=100, total=100)
    assert w * 2 + 20 < w * 10 + 0
    assert kv_aware_decode([idle, holder], 10, hashes, BS)[0] is holder
    busy_holder = _Worker("busy", free=20, total=100, hashes=hashes[:8])
    assert w * 2 + 80 > w * 10 + 0
    assert kv_aware_decode([busy_holder, idle], 10, hashes, BS)[0] is idle
    full_holder = _Worker("full", free=1, total=100, hashes=hashes[:8])
    assert kv_aware_decode([full_holder, idle], 10, hashes, BS)[0] is idle  # no room
    prompt = list(range(160))
    warm = _Worker("warm", 0, 0, hashes[:8], inflight_tokens=50)
    cold = _Worker("cold", 0, 0, inflight_tokens=0)
    assert kv_aware_prefill([cold, warm], prompt, hashes, BS)[0] is warm  # 50 + 32 < 160


# ---- through the router ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(
        tmp_path_factory.mktemp("kv_aware"), num_heads=4, num_kv_heads=2, layers=3, seed=11
    )
    return path


def _spec(tiny_model, **kw) -> ClusterSpec:
    fields = {
        "num_decode": 2,
        "num_blocks": 256,
        "max_model_len": 512,
        "prefill_policy": "kv_aware",
        "decode_policy": "kv_aware",
    }
    return ClusterSpec(model=str(tiny_model), **{**fields, **kw})


def _conversations(n: int, seed: int) -> list[list[list[int]]]:
    """Per conversation, each turn's new user tokens (the first: the opening prompt)."""
    g = torch.Generator().manual_seed(seed)
    opening = [torch.randint(3, 128, (40 + 7 * i,), generator=g).tolist() for i in range(n)]
    return [
        [opening[i]] + [torch.randint(3, 128, (9,), generator=g).tolist() for _ in range(TURNS - 1)]
        for i in range(n)
    ]


def _reference(tiny_model, conversations) -> list[list[list[int]]]:
    """Each conversation's outputs turn by turn, every turn's prompt the whole history."""
    outs = []
    for conv in conversations:
        history, turns = [], []
        for new in conv:
            history = history + new
            [out] = engine_reference(tiny_model, [history], block_size=BS, new_tokens=NEW_TOKENS)
            turns.append(out)
            history = history + out
        outs.append(turns)
    return outs


def _chat(cluster, conversations, between_turns=None):
    """Turn by turn, every conversation's turn at once; returns (outputs, completions)."""
    histories = [[] for _ in conversations]
    outs = [[] for _ in conversations]
    completions = [[] for _ in conversations]
    for turn in range(TURNS):
        if between_turns is not None and turn:
            between_turns(turn)
        for i, conv in enumerate(conversations):
            histories[i] = histories[i] + conv[turn]
        requests = [
            {"token_ids": h, "max_tokens": NEW_TOKENS, "ignore_eos": True, "include_timings": True}
            for h in histories
        ]
        for i, c in enumerate(generate_concurrently(cluster, requests)):
            outs[i].append(list(c.token_ids))
            completions[i].append(c)
            histories[i] = histories[i] + list(c.token_ids)
    return outs, completions


def _refresh(cluster) -> None:
    """One status poll now (the router's picture of every cache as of this moment)."""
    cluster.run(cluster.router.refresh())


@pytest.mark.parametrize("transport", ["grpc", "torch_dist", "local"])
def test_next_turns_stay_where_their_history_is_and_ship_no_kv(tiny_model, transport):
    conversations = _conversations(3, seed=1)
    ref = _reference(tiny_model, conversations)
    with LocalCluster(_spec(tiny_model, kv_transport=transport)) as cluster:
        outs, completions = _chat(cluster, conversations, lambda turn: _refresh(cluster))
        assert_all_blocks_free(cluster)
    assert outs == ref
    for conv in completions:
        first, later = conv[0], conv[1:]
        assert first.timings.kv_bytes > 0  # the opening turn is prefilled and shipped
        for c in later:
            # The decode worker held the history: it prefilled only the tail, nothing moved.
            assert c.timings.kv_bytes == 0
            assert c.usage.prompt_tokens - c.usage.cached_prompt_tokens <= 64
            assert c.usage.cached_prompt_tokens >= BS


def test_a_stale_picture_or_an_evicted_history_costs_a_hit_not_the_output(tiny_model):
    """The router's picture says the decode worker holds the history; the worker evicted it
    (a flood of other prompts through a small cache) and the router has not polled since."""
    conversations = _conversations(2, seed=2)
    ref = _reference(tiny_model, conversations)
    flood = [
        torch.randint(3, 128, (120,), generator=torch.Generator().manual_seed(i)).tolist()
        for i in range(12)
    ]
    spec = _spec(tiny_model, decode_num_blocks=40)

    with LocalCluster(spec) as cluster:
        cluster.loop.call_soon_threadsafe(cluster.router._poller.cancel)  # polls only by hand

        def evict_behind_the_routers_back(turn):
            _refresh(cluster)  # the picture: the history is there
            for i in range(0, len(flood), 2):  # then evict it, unseen (no poll)
                reqs = [
                    {"token_ids": p, "max_tokens": 2, "ignore_eos": True} for p in flood[i : i + 2]
                ]
                generate_concurrently(cluster, reqs)

        outs, completions = _chat(cluster, conversations, evict_behind_the_routers_back)
        assert_all_blocks_free(cluster)
    assert outs == ref
    # The stale picture sent later turns to the decode worker to prefill locally; it found
    # less than the router thought and computed the rest itself.
    later = [c for conv in completions for c in conv[1:]]
    assert any(c.usage.prompt_tokens - c.usage.cached_prompt_tokens > 64 for c in later)


def test_a_dead_decode_worker_between_turns_loses_nothing(tiny_model):
    conversations = _conversations(2, seed=3)
    ref = _reference(tiny_model, conversations)
    spec = _spec(tiny_model, separate_processes=True, threads_per_worker=1)
    with LocalCluster(spec) as cluster:
        killed = []

        def kill_the_holder(turn):
            _refresh(cluster)
            if turn == 2:
                statuses = {a: w for a, w in cluster.router.decode.workers.items()}
                holder = max(statuses.values(), key=lambda w: len(w.kv.hashes))
                index = cluster.decode_addresses.index(holder.address)
                proc = cluster._procs[spec.num_prefill + index]
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                killed.append(holder.address)
                _refresh(cluster)  # the router sees it gone (and forgets its cache)

        outs, _ = _chat(cluster, conversations, kill_the_holder)
        assert_all_blocks_free(cluster, dead=killed)
    assert killed and outs == ref


@pytest.mark.parametrize(
    "transport", transport_params(["grpc", "flight", "torch_dist", "nixl", "shm", "local"])
)
def test_a_longer_next_turn_ships_only_the_blocks_the_decode_worker_lacks(tiny_model, transport):
    """With no local tail (kv_local_tail_tokens 0) every turn goes through a prefill worker:
    the reservation pins the history blocks the decode worker holds and the prefill sends the
    rest only."""
    conversations = _conversations(2, seed=4)
    ref = _reference(tiny_model, conversations)
    spec = _spec(tiny_model, kv_transport=transport, kv_local_tail_tokens=0)
    with LocalCluster(spec) as cluster:
        outs, completions = _chat(cluster, conversations, lambda turn: _refresh(cluster))
        assert_all_blocks_free(cluster)
    assert outs == ref
    for conv in completions:
        first = conv[0]
        per_block = first.timings.kv_bytes // -(-first.usage.prompt_tokens // BS)
        for c in conv[1:]:
            held = c.timings.decode_cached_tokens
            assert held >= BS and held % BS == 0  # whole blocks, pinned on the decode side
            shipped_blocks = -(-c.usage.prompt_tokens // BS) - held // BS
            assert c.timings.kv_bytes == per_block * shipped_blocks


def test_the_conversation_reference_is_transformers_greedy(tiny_model):
    """The engine reference the routing tests compare against is itself transformers' greedy
    output over the same growing histories (a tie aside)."""
    from transformers import AutoModelForCausalLM

    from tests.greedy import assert_same_greedy, hf_greedy

    hf = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    [conv] = _conversations(1, seed=5)
    [turns] = _reference(tiny_model, [conv])
    history: list[int] = []
    for new, ours in zip(conv, turns, strict=True):
        history = history + new
        assert_same_greedy(hf, history, ours, hf_greedy(hf, history, NEW_TOKENS))
        history = history + ours


def test_a_prefix_every_worker_holds_goes_to_a_prefill_worker_and_is_not_shipped(tiny_model):
    """A shared system prompt sits in the prefill worker's cache and in the decode worker's:
    a short prompt behind it is no reason to prefill on the decode side (every running stream
    waits for its steps); it is prefilled on the prefill worker, which ships only the blocks
    past the system prompt."""
    g = torch.Generator().manual_seed(6)
    system = torch.randint(3, 128, (48,), generator=g).tolist()
    prompts = [system + torch.randint(3, 128, (9,), generator=g).tolist() for _ in range(3)]
    ref = engine_reference(tiny_model, prompts, block_size=BS, new_tokens=NEW_TOKENS)
    with LocalCluster(_spec(tiny_model, num_decode=1)) as cluster:
        outs = []
        for p in prompts:
            req = {
                "token_ids": p,
                "max_tokens": NEW_TOKENS,
                "ignore_eos": True,
                "include_timings": True,
            }
            outs += generate_concurrently(cluster, [req])
            _refresh(cluster)
        assert_all_blocks_free(cluster)
    assert [list(o.token_ids) for o in outs] == ref
    per_block = outs[0].timings.kv_bytes // -(-len(prompts[0]) // BS)
    for o in outs[1:]:
        assert o.timings.prefill_cached_tokens == len(system)  # prefilled by the prefill worker
        assert o.timings.decode_cached_tokens == len(system)  # and not shipped
        assert o.timings.kv_bytes == per_block * (-(-len(prompts[0]) // BS) - len(system) // BS)
