"""The config side of security: the controller's per-cluster token, the security and limits
sections, `pdserve serve` refusing an open client API before Ray starts, and the Ray launcher
file keeping the dashboard on loopback with Ray's token authentication on."""

from __future__ import annotations

import math

import pytest
import yaml

from pdserve.cli import main
from pdserve.cluster.ray_controller import Controller
from pdserve.config import CONFIG_DIR, ConfigError, load_config, validate_config, with_cluster_token
from pdserve.security_config import api_security, cluster_tls, request_limits


def test_the_controller_makes_a_random_cluster_token_per_cluster():
    cfg = load_config().model_dump()
    assert cfg["cluster_token"] is None
    a, b = Controller(cfg, "/nowhere"), Controller(cfg, "/nowhere")
    assert a.cfg.cluster_token and b.cfg.cluster_token
    assert a.cfg.cluster_token != b.cfg.cluster_token and len(a.cfg.cluster_token) >= 40
    # What the workers and the router are started with carries it.
    assert a.cfg.model_dump()["cluster_token"] == a.cfg.cluster_token


def test_an_explicit_cluster_token_is_kept():
    cfg = validate_config({"cluster_token": "mine"})
    assert with_cluster_token(cfg).cluster_token == "mine"


def test_security_and_limits_sections_become_server_settings():
    cfg = validate_config(
        {
            "security": {
                "tls": {"cert": "a.pem", "key": "a.key", "client_ca": "ca.pem"},
                "cluster_tls": {"cert": "n.pem", "key": "n.key", "ca": "ca.pem"},
                "open_metrics": True,
            },
            "limits": {"max_stop_strings": 4, "max_prompt_tokens": 100},
        }
    )
    sec = api_security(cfg)
    assert sec.tls.client_ca == "ca.pem" and sec.open_metrics and not sec.allow_unauthenticated
    assert cluster_tls(cfg).ca == "ca.pem"
    limits = request_limits(cfg)
    assert limits.max_stop_strings == 4 and limits.max_prompt_tokens == 100
    assert cluster_tls(validate_config({})) is None


@pytest.mark.parametrize(
    "data, message",
    [
        ({"lease_ttl_s": math.nan}, "lease_ttl_s"),
        ({"lease_ttl_s": math.inf}, "lease_ttl_s"),
        ({"lease_ttl_s": 900}, "limits.max_lease_seconds"),
        ({"limits": {"max_lease_seconds": math.inf}}, "limits.max_lease_seconds"),
        ({"limits": {"max_stop_strings": 0}}, "limits.max_stop_strings: must be >= 1"),
        ({"security": {"tls": {"cert": "a.pem"}}}, "security.tls.key: required"),
        ({"security": {"bogus": 1}}, "security.bogus: unknown field"),
    ],
)
def test_bad_security_fields_are_named(data, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(data)


def test_pdserve_serve_refuses_an_open_api_off_loopback_before_ray_starts(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    config = tmp_path / "open.yaml"
    config.write_text("host: null\n")
    assert main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "without an API key" in err and "--allow-unauthenticated" in err


def test_multi_node_configs_say_what_off_loopback_needs():
    gpu = load_config(CONFIG_DIR / "gpu.yaml")
    assert gpu.host is None and gpu.kv_transport == "torch_dist"
    assert gpu.security.kv_private_network  # NCCL between nodes: the operator's explicit choice


def test_ray_launcher_keeps_the_dashboard_on_loopback_with_token_auth():
    text = (CONFIG_DIR / "ray_cluster.yaml").read_text()
    launcher = yaml.safe_load(text)
    head = " ".join(launcher["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "RAY_AUTH_MODE=token" in head
    assert all(
        "RAY_AUTH_MODE=token" in c for c in launcher["worker_start_ray_commands"] if "start" in c
    )
    commands = head + " ".join(launcher["worker_start_ray_commands"])
    assert "0.0.0.0" not in commands
    assert "ray dashboard" in text and "ssh -L" in text  # how to reach it
