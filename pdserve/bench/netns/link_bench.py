"""KV across a shaped link, `bench transfer`-style: a receiver server on one namespace host, a
sender on another, one prompt's KV (every layer, then the commit that waits for the receiver's
ack) pushed several times; MB/s against the link's configured rate and against raw TCP over
the same link measured in the same run. The two halves run as ``probe`` commands inside their
hosts (``kv-serve``, ``kv-push``, ``tcp-sink``, ``tcp-send``); ``measure_link`` drives them."""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.measure.kv_push import KVShape

CHUNK = 4 * 2**20
SHAPE = KVShape()  # the embedded SmolLM2-135M's cache, 1,024 tokens (bench transfer's shape)


def _tls(spec: dict):
    from grpc_plumbing.tls import ClusterTls

    return ClusterTls(spec["cert"], spec["key"], spec["ca"], None) if spec.get("cert") else None


def _opts(transport: str, spec: dict) -> dict:
    opts = {"token": os.environ["PDSERVE_CLUSTER_TOKEN"]}
    if transport in ("grpc", "flight"):
        opts["tls"] = _tls(spec)
    return opts


def _server_opts(transport: str, spec: dict) -> dict:
    opts = _opts(transport, spec)
    if transport in ("torch_dist", "nixl"):
        opts["private_network"] = True  # the bridge reaches only this run's namespaces
    return opts


def kv_serve(transport: str, host: str, spec_path: str) -> dict:
    """Serve a receiver at ``host``, open ``repeats + 1`` leases, print them, and wait for a
    line on stdin (the driver's "done"; at most 10 minutes) before stopping."""
    from kv_transfer.lease import LeaseTable
    from kv_transfer.receiver import KVReceiver
    from kv_transfer.sender import start_receiver_server

    spec = json.loads(Path(spec_path).read_text())
    leases = LeaseTable(default_ttl_s=600.0)
    server = start_receiver_server(
        transport,
        KVReceiver(SHAPE.make_cache(zero=True), leases),
        host=host,
        **_server_opts(transport, spec),
    )
    tags = [f"push-{i}" for i in range(spec["repeats"] + 1)]
    ids = [leases.open(tag, list(range(SHAPE.num_blocks))).lease_id for tag in tags]
    # request id:lease id, as a reservation names them
    pairs = [f"{tag}:{lease}" for tag, lease in zip(tags, ids)]
    print(json.dumps({"endpoint": server.endpoint, "leases": pairs}), flush=True)
    sys.stdin.readline()
    received = [leases.get(i).bytes_received if i in leases else -1 for i in ids]
    server.stop()
    return {"received": received}


def kv_push(transport: str, endpoint: str, spec_path: str, leases_csv: str) -> dict:
    """Push one prompt's KV into each lease (the first a warm-up); seconds per push."""
    import torch

    from kv_transfer.sender import make_sender

    spec = json.loads(Path(spec_path).read_text())
    torch.manual_seed(0)
    src = SHAPE.make_cache()
    src_ids = torch.randperm(SHAPE.num_blocks).tolist()
    sender = make_sender(transport, endpoint, **_opts(transport, spec))
    seconds, nbytes = [], []
    try:
        for pair in leases_csv.split(","):
            request_id, lease_id = pair.split(":")
            start = time.perf_counter()
            stream = sender.open_stream(request_id, lease_id)
            for layer, (k, v) in enumerate(src):
                stream.send_layer(layer, src_ids, range(SHAPE.num_blocks), k, v)
            stats = stream.commit(timeout=300)
            seconds.append(time.perf_counter() - start)
            nbytes.append(stats.bytes)
    finally:
        sender.close()
    return {"seconds": seconds[1:], "bytes": nbytes[1:]}


def tcp_sink(host: str) -> dict:
    """Accept one connection and read it to the end; print the port first."""
    with socket.create_server((host, 0)) as srv:
        print(json.dumps({"port": srv.getsockname()[1]}), flush=True)
        srv.settimeout(300)
        conn, _ = srv.accept()
        total, buf = 0, bytearray(CHUNK)
        with conn:
            while n := conn.recv_into(buf):
                total += n
            conn.sendall(b"k")  # the sender's clock stops when every byte has arrived
    return {"bytes": total}


def tcp_send(host: str, port: str, total_mib: str) -> dict:
    data, total = bytes(CHUNK), int(total_mib) * 2**20
    with socket.create_connection((host, int(port)), timeout=300) as conn:
        start = time.perf_counter()
        for _ in range(total // CHUNK):
            conn.sendall(data)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)
        return {"seconds": time.perf_counter() - start, "bytes": total}


@dataclass
class LinkReport:
    link_rate: str
    link_mb_s: float  # the tbf rate in MB/s (1e6 bytes)
    tcp_mb_s: float  # raw TCP over the same link, same run
    bytes_per_push: int
    transports: dict  # name -> {"best_mb_s", "median_mb_s", "x_link", "x_tcp", "bytes_ok"}

    def to_dict(self) -> dict:
        return asdict(self)


def rate_mb_s(rate: str) -> float:
    """tc's rate ("1gbit", "200mbit", "500kbit") in MB/s."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for suffix, scale in units.items():
        if rate.endswith(suffix):
            return float(rate[: -len(suffix)]) * scale / 8 / 1e6
    raise ValueError(f"link rate {rate!r}: give a number with gbit, mbit or kbit")


def summarize(seconds: list[float], nbytes: list[int], link: float, tcp: float) -> dict:
    rates = [b / s / 1e6 for b, s in zip(nbytes, seconds)]
    best = max(rates)
    return {
        "best_mb_s": best,
        "median_mb_s": statistics.median(rates),
        "x_link": best / link,
        "x_tcp": best / tcp,
        "bytes_ok": all(b == SHAPE.bytes_per_push for b in nbytes),
    }


# ---- the driver (outside the namespaces) ---------------------------------------------------


def _first_line(proc, timeout_s: float) -> dict:
    """The half's first JSON line, within ``timeout_s``; lines before it are skipped (NIXL
    logs its agent's start to stdout)."""
    import select

    deadline = time.monotonic() + timeout_s
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            proc.kill()
            raise TimeoutError(f"no answer from {proc.args[-4:]} within {timeout_s}s")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{proc.args[-4:]} ended: {proc.stderr.read()[-2000:]}")
        if line.startswith("{"):
            return json.loads(line)


def _half(cluster, host: str, *args: str):
    import subprocess

    argv = [sys.executable, "-m", "pdserve.bench.netns.probe", *args]
    return cluster.hosts.popen(
        host,
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(cluster),
    )


def _env(cluster) -> dict:
    from pdserve.bench.netns.hosts import UCX_ENV

    return {**os.environ, **UCX_ENV, "PDSERVE_CLUSTER_TOKEN": cluster.bench_token}


def _tcp_mb_s(cluster, src: str, dst: str, mib: int) -> float:
    sink = _half(cluster, dst, "tcp-sink", cluster.hosts[dst].address)
    try:
        port = _first_line(sink, 60)["port"]
        out = cluster.probe(
            src, "tcp-send", cluster.hosts[dst].address, str(port), str(mib), env=_env(cluster)
        )
    finally:
        sink.wait(60)
    return out["bytes"] / out["seconds"] / 1e6


def _push(cluster, transport: str, src: str, dst: str, spec: str) -> dict:
    server = _half(cluster, dst, "kv-serve", transport, cluster.hosts[dst].address, spec)
    try:
        served = _first_line(server, 120)
        out = cluster.probe(
            src,
            "kv-push",
            transport,
            served["endpoint"],
            spec,
            ",".join(served["leases"]),
            env=_env(cluster),
        )
    finally:
        server.communicate("done\n", timeout=60)
    return out


def measure_link(
    cluster,
    rate: str,
    transports,
    repeats: int = 3,
    tcp_mib: int = 64,
    src: str = "prefill",
    dst: str = "decode_a",
    log=print,
) -> LinkReport:
    """Raw TCP, then each transport, from ``src`` to ``dst`` over ``src``'s shaped link."""
    import secrets

    cluster.bench_token = secrets.token_urlsafe(32)
    spec = cluster.workdir / "link_bench.json"
    c = cluster.certs
    spec.write_text(json.dumps({"repeats": repeats, "ca": c.ca, "cert": c.cert, "key": c.key}))
    link = rate_mb_s(rate)
    tcp = max(_tcp_mb_s(cluster, src, dst, tcp_mib) for _ in range(2))
    log(f"link {rate} = {link:,.1f} MB/s; raw TCP over it: {tcp:,.1f} MB/s")
    report = LinkReport(rate, link, tcp, SHAPE.bytes_per_push, {})
    for name in transports:
        out = _push(cluster, name, src, dst, str(spec))
        row = summarize(out["seconds"], out["bytes"], link, tcp)
        report.transports[name] = row
        log(
            f"{name:>10}: {row['best_mb_s']:,.1f} MB/s = {row['x_link']:.2f} x link, "
            f"{row['x_tcp']:.2f} x TCP"
        )
    return report
