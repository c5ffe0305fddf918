"""A partition across real hosts (network namespaces, see test_netns_cluster.py): decode host
A's cable is pulled while streams run on it. Every stream finishes, token-exact, on decode host
B; when the cable is back, host A rejoins (or, once Ray declared its node dead, its Ray node is
started again as an autoscaler would, and the controller places the replacement there), and
nothing of A's old leases holds a block."""

from __future__ import annotations

import json
import select
import time

import pytest

from tests.netns_fixtures import netns, serve, wait_all_blocks_free  # noqa: F401
from tests.ray_utils import WAIT_SCALE, engine_reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

LONG = 1000  # tokens per stream: seconds of decoding, so the cut lands mid-stream
TOKEN_TIMEOUT_S = 3.0  # the router's liveness: a stream silent this long migrates


def _decode_on(netns, host: str) -> dict | None:  # noqa: F811
    ip = netns.hosts[host].address
    st = netns.status()
    return next(
        (w for w in st["pools"]["decode"]["workers"] if w["address"].startswith(ip + ":")), None
    )


def _migrations(netns) -> float:  # noqa: F811
    url = f"https://{netns.hosts['head'].address}:8000"  # gpu.yaml's http_port
    return netns.probe("outsider", "migrations", url, netns.certs.ca)["migrations"]


def _first_line(proc, timeout_s: float) -> dict:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"no line within {timeout_s}s"
    return json.loads(proc.stdout.readline())


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s * WAIT_SCALE
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(1)
    return value


def test_streams_cut_off_on_one_decode_host_finish_exact_on_the_other(netns):  # noqa: F811
    # 512 blocks: every stream fits on one decode host once the other is cut off
    serve(netns, "grpc", router={"token_timeout_s": TOKEN_TIMEOUT_S}, num_blocks=512)
    reference = engine_reference(netns.model, netns.prompts, max_tokens=LONG)
    before = _decode_on(netns, "decode_a")
    migrated_before = _migrations(netns)
    running = netns.start_generate(netns.prompts, LONG, signal_after=4)
    try:
        # Every stream has its first tokens: half of them decode on A (one worker per host).
        assert _first_line(running, 300) == {"started": True}
        netns.hosts.set_link("decode_a", up=False)
        cut_at = time.monotonic()
        outs = netns.collect(running, timeout_s=600)
        took = time.monotonic() - cut_at
    finally:
        if running.poll() is None:
            running.kill()
        netns.hosts.set_link("decode_a", up=True)
    assert [o["token_ids"] for o in outs] == reference
    # A's streams went silent and waited out the router's liveness before moving to B.
    assert took > TOKEN_TIMEOUT_S
    assert _migrations(netns) > migrated_before  # some streams were on A and moved
    print(
        f"streams done {took:.1f} s after the cut; longest stream {max(o['e2e_s'] for o in outs):.1f} s"
    )

    def a_back():
        if netns.hosts["decode_a"].address not in netns.ray.alive_ips():
            # Ray declared the node dead (its raylet exits on the way back): start it again.
            netns.ray.restart_worker("decode_a", "decode_gpu")
        w = _decode_on(netns, "decode_a")
        return w if w and w["healthy"] and w["state"] == "ready" else None

    after = _wait(a_back, 120, "decode host A back in the pool")
    st = wait_all_blocks_free(netns)
    assert len(st["pools"]["decode"]["workers"]) == 2
    how = "replaced" if after["address"] != before["address"] else "rejoined"
    print(f"decode host A {how}: {before['address']} -> {after['address']}")
    if after["address"] != before["address"]:  # replaced: the old worker and its leases are gone
        ip, port = before["address"].rsplit(":", 1)
        assert netns.probe("outsider", "tcp", ip, port)["open"] is False
    outs = netns.generate(netns.prompts, 8)
    assert [o["token_ids"] for o in outs] == engine_reference(netns.model, netns.prompts)
    wait_all_blocks_free(netns)
