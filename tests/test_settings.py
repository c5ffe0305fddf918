"""One settings source: every process's frozen settings come from the ClusterConfig in one
function, each default has one home, unknown keywords are errors, and one ``build_worker``
builds both kinds of worker."""

from __future__ import annotations

import dataclasses

import pytest

from decode_worker.launch import DecodeSettings, decode_parser, decode_settings_from_args
from engine.settings import EngineSettings
from grpc_plumbing.tls import ClusterTls, TlsFiles
from grpc_plumbing.worker_process import ServerSettings
from pdserve.cluster.local import ClusterSpec
from pdserve.cluster.workers import build_worker, worker_args
from pdserve.config import ClusterConfig, ConfigError, validate_config, with_cluster_token
from pdserve.settings import settings_from_config
from prefill_worker.launch import PrefillSettings, prefill_parser, prefill_settings_from_args
from router.limits import RequestLimits
from router.settings import RouterSettings
from tests.conftest import tiny_llama_dir

TLS = {"cert": "c.pem", "key": "k.pem", "ca": "ca.pem", "server_name": "pdserve-cluster"}


def test_the_config_defaults_are_the_settings_defaults():
    s = settings_from_config(ClusterConfig(), "10.0.0.1", "/models/m")
    assert s.router == RouterSettings(model_dir="/models/m")
    engine = EngineSettings(model="/models/m", threads=ClusterConfig().pools.prefill.threads)
    server = ServerSettings(host="10.0.0.1")
    assert s.prefill == PrefillSettings(engine=engine, server=server)
    limits = ClusterConfig().limits
    assert s.decode == DecodeSettings(
        engine=engine, server=server, max_lease_s=limits.max_lease_seconds
    )


def test_every_config_field_reaches_the_process_that_uses_it():
    cfg = validate_config(
        {
            "block_size": 8,
            "num_blocks": 99,
            "max_model_len": 300,
            "max_num_seqs": 5,
            "weights": "q4",
            "weight_group": 64,
            "kv_dtype": "int8",
            "device": "cpu",
            "kv_transport": "flight",
            "lease_ttl_s": 12.0,
            "cluster_token": "t",
            "api_key": "k",
            "pools": {"prefill": {"threads": 3}, "decode": {"threads": 2}},
            "router": {"concurrent_reserve_headroom": -1, "local_prefill_max_tokens": 7},
            "security": {"cluster_tls": TLS, "kv_private_network": True},
            "limits": {"max_stop_strings": 4, "max_lease_seconds": 90},
        }
    )
    s = settings_from_config(cfg, "127.0.0.1", "/m")
    assert s.router.block_size == s.prefill.engine.block_size == s.decode.engine.block_size == 8
    assert (s.prefill.engine.threads, s.decode.engine.threads) == (3, 2)
    assert s.decode.engine.num_blocks == 99 and s.decode.engine.max_num_seqs == 5
    for engine in (s.prefill.engine, s.decode.engine):
        assert (engine.weights, engine.weight_group, engine.kv_dtype) == ("q4", 64, "int8")
    assert (s.decode.kv_transport, s.decode.lease_ttl_s, s.decode.max_lease_s) == ("flight", 12, 90)
    assert s.decode.kv_private_network
    assert s.router.concurrent_reserve_headroom == -1 and s.router.local_prefill_max_tokens == 7
    assert s.router.limits.max_stop_strings == 4 and s.router.api_key == "k"
    tls = ClusterTls(**TLS)
    assert s.router.cluster_tls == s.prefill.server.cluster_tls == tls
    assert s.decode.server.cluster_tls == tls
    assert s.router.cluster_token == s.prefill.server.cluster_token == "t"
    assert s.decode.server.cluster_token == "t"


@pytest.mark.parametrize(
    "make",
    [
        lambda: DecodeSettings(no_such_option=1),
        lambda: PrefillSettings(kv_transport="grpc"),  # a decode-only setting
        lambda: RouterSettings(model_dir="m", no_such_option=1),
        lambda: EngineSettings(no_such_option=1),
        lambda: ServerSettings(no_such_option=1),
    ],
)
def test_unknown_keywords_are_an_error(make):
    with pytest.raises(TypeError):
        make()


def test_the_local_harness_refuses_an_unknown_field_by_name():
    with pytest.raises(ConfigError, match="no_such_field: unknown field"):
        ClusterSpec(no_such_field=1)


def test_build_worker_refuses_settings_of_another_role():
    with pytest.raises(TypeError, match="a prefill worker takes PrefillSettings"):
        build_worker("prefill", DecodeSettings())
    with pytest.raises(ValueError, match="unknown worker role 'router'"):
        build_worker("router", PrefillSettings())


def test_a_server_option_the_worker_does_not_take_is_an_error_not_dropped(tmp_path, monkeypatch):
    """The Ray actors used to pass only the keywords a server function accepted; a security
    option it lacked (here kv_private_network) vanished without a word."""
    import decode_worker.server

    def serve_without_private_network(worker, host, port, kv_transport, cluster_token, tls):
        raise AssertionError("must not be reached")

    monkeypatch.setattr(decode_worker.server, "serve_decode_worker", serve_without_private_network)
    path, _ = tiny_llama_dir(tmp_path)
    engine = EngineSettings(model=str(path), num_blocks=8, max_model_len=64, device="cpu")
    with pytest.raises(TypeError, match="kv_private_network"):
        build_worker("decode", DecodeSettings(engine=engine))


def test_the_same_builder_serves_both_roles(tmp_path):
    path, _ = tiny_llama_dir(tmp_path)
    engine = EngineSettings(model=str(path), num_blocks=16, max_model_len=64, device="cpu")
    for role, settings in (("prefill", PrefillSettings), ("decode", DecodeSettings)):
        server = ServerSettings(worker_id=f"{role}-x")
        running = build_worker(role, settings(engine=engine, server=server))
        try:
            assert running.address.startswith("127.0.0.1:")
            status = running.worker.status()
            assert status["num_total_blocks"] == status["num_free_blocks"] == 16
        finally:
            running.stop(grace=None)


ROLES = {
    "prefill": (PrefillSettings, prefill_parser, prefill_settings_from_args, {}),
    "decode": (
        DecodeSettings,
        decode_parser,
        decode_settings_from_args,
        {"kv_transport": "flight", "lease_ttl_s": 7.5, "max_lease_s": 60.0},
    ),
}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_command_lines_read_back_as_the_same_settings(role):
    settings_cls, parser, from_args, extra = ROLES[role]
    engine = EngineSettings(
        model="/m", block_size=8, num_blocks=77, max_num_batched_tokens=256, threads=2, device="cpu"
    )
    engine = dataclasses.replace(engine, weights="int8", kv_dtype="int8")
    server = ServerSettings("127.0.0.2", 1234, None, ClusterTls(**TLS), worker_id="w")
    s = settings_cls(engine=engine, server=server, **extra)
    assert from_args(parser().parse_args(worker_args(role, s))) == s
    assert from_args(parser().parse_args([])) == settings_cls()  # the defaults, one home


def test_cluster_spec_is_a_frozen_view_of_the_cluster_config():
    spec = ClusterSpec(
        model="embedded",
        num_blocks=64,
        prefill_policy="round_robin",
        concurrent_reserve_headroom=0.25,
        threads_per_worker=2,
        router_port=0,
        api_tls=TlsFiles("a.pem", "b.pem"),
        limits=RequestLimits(max_stop_strings=3),
        num_prefill=0,
    )
    cfg = spec.config
    assert cfg.router.prefill_policy == "round_robin" and cfg.num_blocks == 64
    assert cfg.pools.prefill.threads == cfg.pools.decode.threads == 2
    assert cfg.security.tls.cert == "a.pem" and cfg.limits.max_stop_strings == 3
    assert (cfg.host, cfg.grpc_port, cfg.http_port, cfg.device) == ("127.0.0.1", 0, None, "cpu")
    s = spec.settings("/m")
    assert s.router.concurrent_reserve_headroom == 0.25
    assert s.router.limits == RequestLimits(max_stop_strings=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_prefill = 2


def test_a_spec_with_another_config_keeps_the_harness_choices():
    spec = ClusterSpec(num_prefill=0, decode_num_blocks=8, kv_transport="local")
    token = with_cluster_token(spec.config)
    again = spec.with_config(token)
    assert again.cluster_token == token.cluster_token and spec.cluster_token is None
    kept = ("num_prefill", "num_decode", "decode_num_blocks", "test_transport", "extra_env")
    assert all(getattr(again, name) == getattr(spec, name) for name in kept)


def test_the_harness_keeps_its_own_decode_pool_size_and_test_transport():
    s = ClusterSpec(num_blocks=64, decode_num_blocks=8, kv_transport="local").settings("/m")
    assert (s.prefill.engine.num_blocks, s.decode.engine.num_blocks) == (64, 8)
    assert s.decode.kv_transport == "local"
    faults = ClusterSpec(kv_transport="faults", separate_processes=True).settings("/m").decode
    args = decode_parser().parse_args(worker_args("decode", faults))
    assert decode_settings_from_args(args).kv_transport == "faults"
    with pytest.raises(ConfigError, match="kv_transport"):
        ClusterSpec(kv_transport="carrier_pigeon")
