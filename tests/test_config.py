"""The cluster config: shipped YAMLs load, bad fields get messages that name them."""

from __future__ import annotations

import pytest

from pdserve.config import CONFIG_DIR, DEFAULT_CONFIG, ConfigError, load_config, validate_config


@pytest.mark.parametrize("name", ["local.yaml", "2p2d.yaml", "gpu.yaml"])
def test_shipped_configs_are_valid(name):
    cfg = load_config(CONFIG_DIR / name)
    assert cfg.pools.prefill.replicas >= 1 and cfg.pools.decode.replicas >= 1


def test_embedded_default_is_1p1d_cpu_grpc_smollm2():
    cfg = load_config(None)
    assert load_config(DEFAULT_CONFIG) == cfg
    assert cfg.model == "embedded"
    assert (cfg.pools.prefill.replicas, cfg.pools.decode.replicas) == (1, 1)
    assert cfg.pools.prefill.num_gpus == cfg.pools.decode.num_gpus == 0
    assert cfg.pools.prefill.threads >= 1
    assert cfg.kv_transport == "grpc"
    assert not cfg.autoscaler.enabled


def test_gpu_example_asks_one_gpu_per_worker_and_nccl():
    cfg = load_config(CONFIG_DIR / "gpu.yaml")
    assert cfg.pools.prefill.num_gpus == cfg.pools.decode.num_gpus == 1
    assert cfg.kv_transport == "torch_dist"  # "nccl" in the file is its alias
    assert cfg.device == "cuda"


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1", "auto"])
def test_device_names_are_accepted_without_a_gpu(device):
    assert validate_config({"device": device}).device == device


@pytest.mark.parametrize("device", ["tpu", "gpu", "cpu:0", "cuda:x", ""])
def test_bad_device_is_refused_naming_the_field(device):
    with pytest.raises(ConfigError, match=r"^config is invalid:\ndevice: device "):
        validate_config({"device": device})


def test_ray_launcher_file_has_head_and_worker_types():
    import yaml

    launcher = yaml.safe_load((CONFIG_DIR / "ray_cluster.yaml").read_text())
    assert launcher["head_node_type"] in launcher["available_node_types"]
    resources = [t["resources"] for t in launcher["available_node_types"].values()]
    assert any("prefill_node" in r for r in resources) and any(
        "decode_node" in r for r in resources
    )


def _error(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(data)
    return str(info.value)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"pools": {"decode": {"replicas": 0}}}, "pools.decode.replicas: must be >= 1"),
        ({"pools": {"prefill": {"num_cpus": -1}}}, "pools.prefill.num_cpus: must be >= 0"),
        (
            {"pools": {"decode": {"replicas": 5, "max": 4}}},
            "pools.decode: replicas (5) must be within",
        ),
        (
            {"pools": {"decode": {"min": 3, "max": 2, "replicas": 2}}},
            "pools.decode: min (3) must be <= max",
        ),
        ({"pools": {"decode": {"replica": 2}}}, "pools.decode.replica: unknown field"),
        (
            {"kv_transport": "pigeon"},
            "kv_transport: Input should be 'grpc', 'flight', 'torch_dist', 'nixl' or 'shm'",
        ),
        ({"grpc_port": 70000}, "grpc_port: must be <= 65535"),
        ({"autoscaler": {"tpot_target_s": 0}}, "autoscaler.tpot_target_s: must be > 0"),
        ({"block_size": "big"}, "block_size: Input should be a valid integer"),
    ],
)
def test_bad_field_is_named_with_a_clear_message(data, message):
    assert message in _error(data)


def test_every_bad_field_is_reported_at_once():
    msg = _error({"pools": {"decode": {"replicas": 0}}, "num_blocks": 0, "colour": "red"})
    assert "pools.decode.replicas" in msg and "num_blocks" in msg and "colour: unknown field" in msg


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read cluster config"):
        load_config(tmp_path / "missing.yaml")
    bad.write_text("pools:\n  decode:\n    replicas: 0\n")
    with pytest.raises(
        ConfigError, match=r"bad.yaml is invalid:\npools.decode.replicas: must be >= 1"
    ):
        load_config(bad)


def test_relative_model_path_becomes_absolute(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    assert validate_config({"model": "m"}).model == str(tmp_path / "m")
    assert validate_config({"model": "embedded"}).model == "embedded"
