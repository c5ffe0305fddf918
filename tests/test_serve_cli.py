"""``pdserve serve [MODEL]``'s operator flags (issue 52): each lands in its config field and wins
over the YAML, a flag not given leaves the YAML's value, ``$PDSERVE_API_KEY`` is used and never
printed, a bad value names its flag (argparse-style, exit 2, before Ray starts); and, slow,
``pdserve serve embedded --prefill 1 --decode 2 --port P`` serves a completion and stops clean.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest
import yaml

from pdserve.cli import build_parser
from pdserve.config import REPO_ROOT, load_config
from pdserve.serve_args import API_KEY_ENV, FlagError, apply_serve_args

SECRET = "sk-serve-cli-secret-1234"


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def apply(*argv: str, cfg=None, environ=None):
    return apply_serve_args(cfg or load_config(), serve_args(*argv), environ or {})


def run_cli(*argv: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV} | (env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env=env,
    )


@pytest.fixture
def hf_folder(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def test_each_flag_lands_in_its_config_field(hf_folder):
    cfg = apply(
        *(str(hf_folder), "--prefill", "3", "--decode", "5", "--kv-transport", "flight"),
        *("--host", "0.0.0.0", "--port", "8123", "--grpc-port", "50123", "--api-key", SECRET),
        *("--max-model-len", "1024", "--weights", "int8", "--kv-dtype", "int8"),
        *("--served-model-name", "my-model", "--tensor-parallel-size", "1:2"),
    )
    assert cfg.model == str(hf_folder.resolve())
    assert (cfg.pools.prefill.replicas, cfg.pools.decode.replicas) == (3, 5)
    assert (cfg.pools.prefill.tensor_parallel_size, cfg.pools.decode.tensor_parallel_size) == (1, 2)
    # The YAML's bounds (1..2) widen to hold what was asked for.
    assert (cfg.pools.prefill.min, cfg.pools.prefill.max) == (1, 3)
    assert (cfg.pools.decode.min, cfg.pools.decode.max) == (1, 5)
    assert (cfg.kv_transport, cfg.host, cfg.http_port, cfg.grpc_port) == (
        "flight",
        "0.0.0.0",
        8123,
        50123,
    )
    assert (cfg.api_key, cfg.max_model_len, cfg.weights, cfg.kv_dtype, cfg.model_name) == (
        SECRET,
        1024,
        "int8",
        "int8",
        "my-model",
    )


def test_vllm_spellings_and_embedded():
    cfg = apply("embedded", "-tp", "1", "--kv-cache-dtype", "fp8")
    assert (cfg.model, cfg.kv_dtype) == ("embedded", "fp8")


def test_the_flag_wins_over_the_yaml_and_the_yaml_stands_where_no_flag(tmp_path):
    data = yaml.safe_load((REPO_ROOT / "cluster_configs" / "local.yaml").read_text())
    data |= {"http_port": 9000, "grpc_port": 9001, "model_name": "from-yaml", "api_key": "yk"}
    data["pools"]["decode"] |= {"replicas": 2, "min": 2, "max": 4}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    yaml_cfg = load_config(path)
    cfg = apply("--port", "9100", "--decode", "3", "--api-key", SECRET, cfg=yaml_cfg)
    assert (cfg.http_port, cfg.pools.decode.replicas, cfg.api_key) == (9100, 3, SECRET)
    assert (cfg.pools.decode.min, cfg.pools.decode.max) == (2, 4)  # already hold 3
    assert (cfg.grpc_port, cfg.model_name, cfg.model) == (9001, "from-yaml", yaml_cfg.model)
    assert cfg.pools.prefill == yaml_cfg.pools.prefill
    # Nothing given: the YAML's config as it was (the environment's key only where it has none).
    assert apply(cfg=yaml_cfg, environ={API_KEY_ENV: "env"}) == yaml_cfg


def test_the_api_key_comes_from_the_environment_and_is_never_printed():
    assert apply(environ={API_KEY_ENV: SECRET}).api_key == SECRET
    assert apply("--api-key", "flag", environ={API_KEY_ENV: SECRET}).api_key == "flag"
    assert apply().api_key is None
    env = {API_KEY_ENV: SECRET}
    help_out = run_cli("serve", "--help", env_extra=env)
    assert help_out.returncode == 0 and "--api-key" in help_out.stdout
    bad = run_cli("serve", "--api-key", SECRET, "--port", "70000", env_extra=env)
    assert bad.returncode == 2
    assert SECRET not in help_out.stdout + bad.stdout + bad.stderr


@pytest.mark.parametrize(
    ("argv", "flag", "says"),
    [
        (["--prefill", "-1"], "--prefill", "pools.prefill.replicas: must be >= 1"),
        (["--decode", "0"], "--decode", "pools.decode.replicas: must be >= 1"),
        (["--port", "70000"], "--port", "http_port: must be <= 65535"),
        (["--grpc-port", "-2"], "--grpc-port", "grpc_port: must be >= 0"),
        (["--max-model-len", "1"], "--max-model-len", "max_model_len: must be >= 2"),
        (["/no/such/model"], "MODEL", "no such file or folder"),
    ],
)
def test_a_bad_value_names_its_flag(argv, flag, says):
    with pytest.raises(FlagError) as e:
        apply(*argv)
    assert e.value.flag == flag and says in e.value.message, e.value


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--kv-transport", "nope"], "argument --kv-transport: invalid choice: 'nope'"),
        (["--tensor-parallel-size", "2:x"], "argument --tensor-parallel-size/-tp: expected K or"),
        (["--port", "http"], "argument --port: invalid int value"),
        (["--weights", "fp64"], "argument --weights: invalid choice"),
    ],
)
def test_a_malformed_value_is_refused_by_the_parser(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        serve_args(*argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_pdserve_serve_refuses_bad_flags_before_ray_starts(tmp_path):
    for argv, says in [
        (["--port", "70000"], "argument --port: http_port: must be <= 65535"),
        ([str(tmp_path / "missing")], "argument MODEL: no such file or folder"),
        (["--kv-transport", "nope"], "argument --kv-transport: invalid choice"),
    ]:
        out = run_cli("serve", *argv)
        assert out.returncode == 2, out.stderr
        assert f"pdserve serve: error: {says}" in out.stderr
        assert "Traceback" not in out.stderr and "ray" not in out.stderr.lower()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


@pytest.mark.slow
def test_serve_embedded_1p2d_answers_and_stops_on_sigterm():
    from tests.test_ray_cluster import _read_until_ready

    port = _free_port()
    argv = ["serve", "embedded", "--prefill", "1", "--decode", "2", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, "RAY_ADDRESS")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", *argv, "--grpc-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO_ROOT,
        env=env,
    )
    lines: list[str] = []
    try:
        addresses = _read_until_ready(proc, lines)
        assert addresses["http"].endswith(f":{port}"), addresses
        body = {"model": "smollm2", "prompt": "Name three fruits:", "max_tokens": 8}
        out = _post(f"http://127.0.0.1:{port}/v1/completions", body | {"temperature": 0})
        assert out["choices"][0]["text"] and out["usage"]["completion_tokens"] == 8, out
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "shutting down" in "".join(lines)
