"""Tensor parallelism in the engine (engine/tensor_parallel.py, engine/tp_ranks.py): greedy
output token-exact against transformers at TP=2, 3 and 4 on CPU (gloo) for tiny random Llama,
Mistral and Qwen2 models, KV heads replicated past the model's count, each rank's cache holding
its own KV heads, the shards of every weight adding up to the whole, and ranks that die."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.llm_engine import build_engine
from engine.request import SamplingParams
from engine.settings import EngineSettings
from engine.tensor_parallel import TPShard, check_tensor_parallel, read_hf_shard
from engine.tp_ranks import COLLECTIVE_TIMEOUT_S, STOP_GRACE_S
from tests.conftest import needs_embedded, tiny_llama_dir, write_word_tokenizer
from tests.greedy import assert_same_greedy, hf_greedy

NEW_TOKENS = 12
BLOCK = 16
PROMPT_LENGTHS = [BLOCK, BLOCK + 1, 2 * BLOCK + 1, 5]
DEADLINE_S = COLLECTIVE_TIMEOUT_S + 10  # a lost rank is reported by then, whatever the path


def tiny_dir(tmp_path, family: str, heads: int, kv_heads: int, seed: int = 0):
    """A random tiny checkpoint of ``family`` (llama | mistral | qwen2) in a Hugging Face folder."""
    if family == "llama":
        return tiny_llama_dir(tmp_path, num_heads=heads, num_kv_heads=kv_heads, seed=seed)
    import transformers

    config_cls, model_cls = {
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    torch.manual_seed(seed)
    head_dim, vocab = 16, 128
    cfg = config_cls(
        vocab_size=vocab,
        hidden_size=heads * head_dim,
        intermediate_size=2 * heads * head_dim,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=0.3,  # peaky logits: greedy ties are rare
        tie_word_embeddings=False,
        sliding_window=None,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = model_cls(cfg).float().eval()
    if family == "qwen2":  # nonzero q/k/v biases, so their shards are checked too
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in ("q_proj", "k_proj", "v_proj"):
                    getattr(layer.self_attn, proj).bias.normal_(0.0, 0.3)
    path = tmp_path / f"tiny-{family}-h{heads}-kv{kv_heads}"
    model.save_pretrained(path)
    write_word_tokenizer(path, vocab)
    return path, model


def tp_engine(path, tp: int, **kw):
    s = EngineSettings(
        str(path), num_blocks=128, device="cpu", threads=1, tensor_parallel_size=tp, **kw
    )
    return build_engine(s)


def prompts_for(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def assert_greedy_exact(engine, hf_model, chunk_note=""):
    prompts = prompts_for(hf_model.config.vocab_size)
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = engine.generate(prompts, params)
    for prompt, req in zip(prompts, outs):
        assert req.error is None, f"{chunk_note}{req.error}"
        ref = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert_same_greedy(hf_model, prompt, req.output_token_ids, ref)
    assert engine.blocks.num_free == engine.blocks.num_total, "KV blocks leaked"


# ---- greedy output against transformers --------------------------------------------------

CASES = [
    pytest.param("llama", 8, 4, 2, id="llama-tp2"),
    pytest.param("mistral", 8, 4, 2, id="mistral-tp2"),
    pytest.param("qwen2", 8, 4, 2, id="qwen2-tp2"),
    pytest.param("llama", 9, 3, 3, id="embedded-shape-9q3kv-tp3"),
    pytest.param("llama", 8, 2, 4, id="llama-tp4-kv-replicated"),
    pytest.param("llama", 8, 4, 4, id="llama-tp4", marks=pytest.mark.slow),
    pytest.param("mistral", 8, 4, 4, id="mistral-tp4", marks=pytest.mark.slow),
    pytest.param("qwen2", 8, 4, 4, id="qwen2-tp4", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("family,heads,kv_heads,tp", CASES)
def test_greedy_matches_transformers_at_every_degree(tmp_path, family, heads, kv_heads, tp):
    path, hf_model = tiny_dir(tmp_path, family, heads, kv_heads)
    # Chunks of 16 make mixed prefill/decode steps: every plan shape goes to the followers.
    engine = tp_engine(path, tp, prefill_chunk_size=BLOCK, max_num_batched_tokens=24)
    try:
        cfg = engine.config.model
        local = engine.runner.model.cfg
        assert (local.num_heads, local.intermediate_size) == (
            heads // tp,
            cfg.intermediate_size // tp,
        )
        # Rank 0's cache holds its KV heads only: kv / tp of them, or one replicated head.
        assert engine.runner.kv_caches[0][0].shape[2] == max(1, kv_heads // tp)
        assert engine.runner.model.cpu_stack is None  # per layer: the all-reduces go between
        assert_greedy_exact(engine, hf_model)
    finally:
        engine.close()


@pytest.mark.slow
@needs_embedded
def test_the_embedded_model_at_tp3_matches_transformers():
    """SmolLM2-135M (9 query, 3 KV heads; GGUF read through its converted folder) split three
    ways gives transformers' greedy tokens (a divergence allowed only at a logit near-tie, as
    tests/test_engine_greedy_smollm2.py allows TP=1)."""
    from transformers import AutoModelForCausalLM

    from engine.model_files import EMBEDDED_GGUF, embedded_gguf_path

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land"]
    params = SamplingParams(max_tokens=24, min_tokens=24)
    s = EngineSettings("embedded", num_blocks=64, device="cpu", threads=1)
    engine = build_engine(replace(s, tensor_parallel_size=3))
    try:
        assert (engine.runner.model.cfg.num_heads, engine.runner.model.cfg.num_kv_heads) == (3, 1)
        results = engine.generate(prompts, params)
    finally:
        engine.close()
    gguf = embedded_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=EMBEDDED_GGUF, dtype=torch.float32
    ).eval()
    for r in results:
        ref = hf_greedy(hf, r.prompt_token_ids, 24)
        assert_same_greedy(hf, r.prompt_token_ids, r.output_token_ids, ref)


@pytest.mark.slow  # the random-weight path of benchmarks and profiles; ~10-25 s
def test_dummy_weights_shard_to_the_same_model(tmp_path):
    """--load-format dummy at TP=2 makes TP=1's random model, each rank its slices: the
    same greedy tokens."""
    path = tmp_path / "dummy"
    path.mkdir()
    hf_cfg = {
        "model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "eos_token_id": 2,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(hf_cfg))
    prompts = prompts_for(96, seed=3)
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    whole = build_engine(
        EngineSettings(str(path), num_blocks=64, device="cpu", load_format="dummy")
    )
    expected = [r.output_token_ids for r in whole.generate(prompts, params)]
    engine = tp_engine(path, 2, load_format="dummy")
    try:
        assert [r.output_token_ids for r in engine.generate(prompts, params)] == expected
    finally:
        engine.close()


# ---- sharding, without processes ----------------------------------------------------------


def _cfg(heads, kv, inter=128) -> ModelConfig:
    return ModelConfig("llama", 96, heads * 16, inter, 2, heads, kv, 16, 1e-5, 1e4, 256, False)


def test_replicated_kv_heads_follow_vllm_placement():
    cfg = _cfg(8, 2)
    assert [TPShard(r, 4).kv_heads(cfg) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    # Each rank's query heads belong to the KV head it holds (group of 4 query heads per KV).
    for r in range(4):
        q0, q1 = TPShard(r, 4).q_heads(cfg)
        assert {h // 4 for h in range(q0, q1)} == {TPShard(r, 4).kv_heads(cfg)[0]}
    local = TPShard(1, 3).local_config(_cfg(9, 3, inter=288))
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, 96)


@pytest.mark.parametrize(
    "heads,kv,inter,tp,what",
    [(8, 4, 128, 3, "attention heads"), (6, 4, 96, 3, "KV heads"), (8, 8, 100, 8, "MLP")],
)
def test_a_degree_that_does_not_divide_is_refused_by_name(heads, kv, inter, tp, what):
    with pytest.raises(ValueError, match=f"tensor_parallel_size {tp}: .*{what}"):
        check_tensor_parallel(_cfg(heads, kv, inter), tp)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(_cfg(heads, kv, inter), tensor_parallel_size=tp)
    with pytest.raises(ValueError, match="tensor_parallel_size 0"):
        check_tensor_parallel(_cfg(8, 4), 0)


def test_shards_read_from_safetensors_add_up_to_the_whole(tmp_path):
    """Each rank's slices (read as slices) are the whole tensor's; concatenated in rank order
    along the split dimension they give it back."""
    from safetensors.torch import load_file

    from engine.loader import load_config

    path, _ = tiny_dir(tmp_path, "qwen2", 8, 4)
    cfg, files = load_config(path), sorted(path.glob("*.safetensors"))
    whole = load_file(str(files[0]))
    shards = [read_hf_shard(files, cfg, TPShard(r, 2)) for r in range(2)]
    for name, t in whole.items():
        cut = TPShard(0, 2).hf_cut(name, cfg)
        if cut is None:
            assert all(torch.equal(s[name], t) for s in shards), name
        else:
            assert torch.equal(torch.cat([s[name] for s in shards], dim=cut[0]), t), name


@pytest.mark.parametrize("heads,kv", [(8, 4), (8, 2), (9, 3), (8, 8)])
def test_kv_between_degrees_moves_each_head_once_into_every_rank_that_holds_it(heads, kv):
    """For every pair of degrees a -> b (replicated cases too): the prefill side sends each
    KV head once, from one rank that holds it, each rank's slice in frames of its own
    (prefill_worker.worker.kv_sources); the decode side's receiver writes each frame's heads
    into every rank that holds them (replicas included), and the lease's commit is complete
    only once every head of every layer x block came."""
    from kv_transfer.frame import encode_kv_frame
    from kv_transfer.lease import LeaseTable
    from kv_transfer.receiver import KVReceiver, RankCache
    from prefill_worker.worker import kv_sources

    cfg = _cfg(heads, kv, inter=heads * 32)
    whole = torch.randn(2, 3, 4, kv, 8)  # K/V x blocks x block size x heads x head dim
    degrees = [k for k in range(1, 2 * heads + 1) if not heads % k and not (kv % k and k % kv)]
    for a in degrees:
        src = [TPShard(r, a).kv_heads(cfg) for r in range(a)]
        rank_caches = [
            (h, [(whole[0][:, :, h[0] : h[1]], whole[1][:, :, h[0] : h[1]])]) for h in src
        ]
        sources = kv_sources(rank_caches)
        sent = [h or (0, kv) for h, _ in sources]
        assert sorted(x for lo, hi in sent for x in range(lo, hi)) == list(range(kv)), a
        assert a == 1 or all(hi - lo < kv or kv == 1 for lo, hi in sent), a  # nobody ships it all
        for b in degrees:
            ranks = [TPShard(r, b).kv_heads(cfg) for r in range(b)]
            empty = [torch.zeros(3, 4, hi - lo, 8) for lo, hi in ranks]
            caches = [RankCache(h, [(e, e.clone())]) for h, e in zip(ranks, empty)]
            leases = LeaseTable(num_layers=1, num_heads=kv)
            receiver = KVReceiver(caches[0].caches, leases, ranks=caches)
            lease = leases.open("r", [0, 1, 2])
            for i, (h, layer) in enumerate(sources):
                assert lease.missing() is not None, (a, b, i)
                kv_t = torch.stack([layer[0][0], layer[0][1]]).contiguous()
                receiver.accept(*encode_kv_frame("r", lease.lease_id, 0, [0, 1, 2], kv_t, heads=h))
            assert lease.missing() is None, (a, b)
            for c in caches:
                lo, hi = c.heads
                assert torch.equal(c.caches[0][0], whole[0][:, :, lo:hi]), (a, b, c.heads)
                assert torch.equal(c.caches[0][1], whole[1][:, :, lo:hi]), (a, b, c.heads)


def test_an_engine_of_a_degree_that_does_not_divide_spawns_nothing(tmp_path):
    import multiprocessing

    path, _ = tiny_dir(tmp_path, "llama", 4, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size 3: must divide the model's 4"):
        tp_engine(path, 3)
    assert multiprocessing.active_children() == []


def test_one_sided_transports_are_refused_for_tensor_parallel_workers():
    """nixl and shm write into rank 0's cache alone: refused by the config and the worker."""
    from decode_worker.launch import DecodeSettings, start_decode_worker
    from pdserve.config import ConfigError, validate_config

    engine = replace(EngineSettings(), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="kv_transport shm writes into rank 0's cache only"):
        start_decode_worker(DecodeSettings(engine=engine, kv_transport="shm"))
    pools = {"decode": {"tensor_parallel_size": 3}}
    with pytest.raises(ConfigError, match="kv_transport shm writes into one cache"):
        validate_config({"model": "embedded", "kv_transport": "shm", "pools": pools})


def test_the_cluster_config_takes_each_pools_degree_where_it_divides_the_heads(tmp_path):
    from pdserve.config import ClusterConfig, ConfigError, validate_config

    path, _ = tiny_dir(tmp_path, "llama", 4, 2)
    data = ClusterConfig(model=str(path)).model_dump()
    data["pools"]["prefill"]["tensor_parallel_size"] = 2
    data["pools"]["decode"]["tensor_parallel_size"] = 4  # KV heads replicated
    cfg = validate_config(data, "the test's config")
    assert (cfg.pools.prefill.tensor_parallel_size, cfg.pools.decode.tensor_parallel_size) == (2, 4)
    data["pools"]["decode"]["tensor_parallel_size"] = 3
    with pytest.raises(ConfigError, match="pools.decode.tensor_parallel_size 3: must divide the"):
        validate_config(data, "the test's config")


# ---- ranks that die --------------------------------------------------------------------


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie has exited
    except FileNotFoundError:
        return True


def _wait_exited(pids, deadline_s: float) -> list[int]:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and not all(_exited(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if not _exited(p)]


def test_a_killed_follower_fails_the_step_and_the_others_exit(tmp_path):
    path, _ = tiny_dir(tmp_path, "llama", 9, 3)
    engine = tp_engine(path, 3)
    try:
        procs = engine.runner.ranks.procs
        params = SamplingParams(max_tokens=200, min_tokens=200)
        engine.add_request(prompts_for(128)[2], params)
        for _ in range(3):
            assert [o.error for o in engine.step()] == [None]
        os.kill(procs[0].pid, signal.SIGKILL)  # rank 1, mid-stream
        t0 = time.monotonic()
        outs = engine.step()
        assert time.monotonic() - t0 < DEADLINE_S
        assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "error"
        assert "tensor-parallel" in outs[0].error and "rank 1" in outs[0].error, outs[0].error
        assert engine.blocks.num_free == engine.blocks.num_total
        assert _wait_exited([p.pid for p in procs], STOP_GRACE_S + 10) == []
        # Broken for good: the next request fails at once with the same cause.
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
        (out,) = engine.step()
        assert out.finish_reason == "error" and "rank 1" in out.error
    finally:
        engine.close()


def test_a_hung_follower_fails_the_step_at_the_collective_timeout(tmp_path):
    """An idle engine keeps no collective open (idle past the timeout, it still steps); a
    follower stopped (SIGSTOP) mid-stream fails rank 0's step at the collective timeout."""
    from engine.llm_engine import LLMEngine, engine_config
    from engine.tp_ranks import start_tensor_parallel

    path, _ = tiny_dir(tmp_path, "llama", 4, 2)
    s = EngineSettings(str(path), num_blocks=32, device="cpu", threads=1, tensor_parallel_size=2)
    timeout_s = 3.0
    loaded, runner = start_tensor_parallel(s, timeout_s=timeout_s)
    engine = LLMEngine(engine_config(s, loaded.config), loaded.weights, loaded.tokenizer, runner)
    follower = runner.ranks.procs[0]
    try:
        time.sleep(timeout_s + 1)  # idle longer than the collective timeout
        engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=50, min_tokens=50))
        assert [o.error for o in engine.step()] == [None]
        os.kill(follower.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        (out,) = engine.step()
        assert time.monotonic() - t0 < timeout_s + 10
        assert (
            out.finish_reason == "error"
            and "tensor-parallel engine of 2 ranks is down" in out.error
        )
        assert engine.blocks.num_free == engine.blocks.num_total
        assert _wait_exited([follower.pid], STOP_GRACE_S + 10) == []  # killed, stopped as it was
    finally:
        engine.close()


RANK0 = """
import sys, time
from engine.llm_engine import build_engine
from engine.settings import EngineSettings
e = build_engine(EngineSettings(sys.argv[1], num_blocks=32, device="cpu", threads=1,
                                tensor_parallel_size=2))
print(" ".join(str(p.pid) for p in e.runner.ranks.procs), flush=True)
time.sleep(600)
"""


def test_followers_exit_when_rank_0_is_killed(tmp_path):
    path, _ = tiny_dir(tmp_path, "llama", 4, 2)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    rank0 = subprocess.Popen(
        [sys.executable, "-c", RANK0, str(path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        pids = [int(p) for p in rank0.stdout.readline().split()]
        assert len(pids) == 1 and not _exited(pids[0])
        rank0.kill()
        rank0.wait(10)
        assert _wait_exited(pids, 10) == [], "a follower outlived rank 0"
    finally:
        rank0.kill()
