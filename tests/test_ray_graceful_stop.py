"""A stop that does not cut streams, under Ray (issue 46): SIGTERM to ``pdserve serve`` with 6
streams running lets all 6 finish with the text of an undisturbed run while new requests get
429 with Retry-After, and the process exits within the drain grace period; a router actor
that dies (``ray.kill``) is restarted by the controller on the same address and serves."""

from __future__ import annotations

import json
import signal
import time

import pytest
import ray
import yaml

from pdserve.cluster.ray_controller import NAMESPACE, ROUTER_NAME
from pdserve.cluster.ray_launcher import launch
from tests.conftest import tiny_llama_dir
from tests.ray_utils import engine_reference, generate, init_local_ray, make_prompts, tiny_config
from tests.ray_utils import wait_for as wait_until
from tests.test_graceful_stop import STREAMS, Stream, _body, _post_status
from tests.test_ray_cluster import _read_until_ready, pdserve_actors, start_serve

GRACE_S = 30.0
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def ray_address():
    yield init_local_ray()
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("ray-stop"), num_kv_heads=2, seed=4)
    return path


def _slow_decode_steps(delay_s: float) -> None:
    """Every decode worker's steps take ``delay_s`` longer (so streams run while we stop)."""

    def slow(actor):
        import time

        worker = actor.running.worker
        updated = worker.on_updated
        worker.on_updated = lambda reqs: (time.sleep(delay_s), updated(reqs))[1]

    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith("pdserve-decode-"):
            actor = ray.get_actor(a["name"], namespace=NAMESPACE)
            ray.get(actor.__ray_call__.remote(slow), timeout=30)


def _streams(address: str) -> list[Stream]:
    streams = [Stream(address, _body(i, MAX_TOKENS)) for i in range(STREAMS)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(60)
    return streams


def _refused_while_draining(address: str, deadline: float) -> tuple[int, dict, dict]:
    """A new request during the drain: retried until it is refused (a request the router
    took before its drain began is served, as it should be)."""
    while True:
        status, headers, body = _post_status(address, {**_body(0, 2), "stream": False})
        if status != 200 or time.monotonic() > deadline:
            return status, headers, body
        time.sleep(0.05)


def test_sigterm_drains_running_streams_and_exits_within_the_grace_period(
    ray_address, tiny_model, tmp_path
):
    config = tmp_path / "cluster.yaml"
    cfg = tiny_config(tiny_model, http_port=0, drain_grace_s=GRACE_S)
    config.write_text(yaml.safe_dump(cfg.model_dump()))
    proc = start_serve(config, "--address", ray_address)
    lines: list[str] = []
    try:
        http = _read_until_ready(proc, lines)["http"]
        undisturbed = _streams(http)
        for s in undisturbed:
            s.join(60)
        reference = [s.text for s in undisturbed]
        assert all(reference)
        _slow_decode_steps(0.05)
        streams = _streams(http)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        status, headers, body = _refused_while_draining(http, t0 + 10)
        assert status == 429 and int(headers["retry-after"]) >= 1, (status, body)
        assert any(s.is_alive() for s in streams), "the streams ended before the stop"
        for s, want in zip(streams, reference, strict=True):
            s.join(GRACE_S)
            assert s.done and not s.errors and s.text == want, (s.errors, s.text[-40:])
        streams_s = time.monotonic() - t0
        assert proc.wait(GRACE_S) == 0, "".join(lines)
        exit_s = time.monotonic() - t0
        print(
            f"after SIGTERM: streams done in {streams_s:.1f} s, pdserve serve exited in "
            f"{exit_s:.1f} s (grace {GRACE_S:.0f} s)"
        )
        assert exit_s < GRACE_S
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "shutting down" in "".join(lines)
    wait_until(lambda: not pdserve_actors(), 30, "every pdserve actor to go away")


def test_a_killed_router_actor_is_restarted_on_its_address(ray_address, tiny_model):
    prompts = make_prompts(4)
    reference = engine_reference(tiny_model, prompts)
    with launch(tiny_config(tiny_model), progress=False) as cluster:
        assert [o.token_ids for o in generate(cluster.grpc_address, prompts)] == reference
        ray.kill(ray.get_actor(ROUTER_NAME, namespace=NAMESPACE))
        t0 = time.monotonic()

        def serves():
            try:
                return [o.token_ids for o in generate(cluster.grpc_address, prompts)]
            except Exception:  # noqa: BLE001 - not back yet
                return None

        assert wait_until(serves, 60, "the router to come back") == reference
        back_s = time.monotonic() - t0
        print(f"the router served again {back_s:.1f} s after it was killed")
        st = cluster.status()
        assert st["router"]["grpc"] == cluster.grpc_address, json.dumps(st["router"])
        assert any("restarting it" in e for e in st["events"]), st["events"]
        assert any("router back" in e for e in st["events"]), st["events"]
        assert back_s < 60
