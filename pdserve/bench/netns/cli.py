"""`pdserve bench netns-cluster`: the namespace cluster for an operator (root, Linux).

up       hosts, Ray nodes and `pdserve serve`; prints the addresses and waits (Ctrl-C: all
         of it removed)
link     the shaped-link figures: KV MB/s across hosts per transport against the link's rate
         and raw TCP, and the exposed KV transfer's share of TTFT at 1,024 tokens
cleanup  remove every namespace (and the processes in it) named with --prefix, e.g. after a
         run was killed
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import threading
from pathlib import Path

TRANSPORTS = ("grpc", "flight", "torch_dist")  # link's default; nixl (pdserve[nixl]) by name


def add_parser(sub) -> None:
    p = sub.add_parser("netns-cluster", help="pdserve across network-namespace hosts (root)")
    p.add_argument("action", choices=("up", "link", "cleanup"))
    p.add_argument("--prefix", default=None, help="namespace name prefix (cleanup: pdsv-)")
    p.add_argument("--model", default="embedded")
    p.add_argument("--kv-transport", default="grpc", choices=(*TRANSPORTS, "nixl"))
    p.add_argument("--link-rate", default="1gbit", help="tbf rate of the prefill host's link")
    p.add_argument("--transports", default=",".join(TRANSPORTS), help="link: KV transports")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ttft-runs", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=cmd_netns_cluster)


def cmd_netns_cluster(args) -> int:
    from pdserve.bench.netns.hosts import PREFIX_ROOT, cleanup

    if args.action == "cleanup":
        removed = cleanup(args.prefix or PREFIX_ROOT)
        print(f"removed {len(removed)} namespaces: {' '.join(removed) or '-'}")
        return 0
    from pdserve.bench.netns.cluster import NetnsCluster

    workdir = Path(tempfile.mkdtemp(prefix="pdsv-netns-"))
    cluster = NetnsCluster(workdir, args.prefix, link_rate=args.link_rate)
    try:
        if args.action == "up":
            return _up(cluster, args)
        return _link(cluster, args)
    finally:
        cluster.close()
        shutil.rmtree(workdir, ignore_errors=True)  # its certificates and the API key


def _up(cluster, args) -> int:
    address = cluster.start_pdserve(_model(args.model), args.kv_transport)
    for host in cluster.hosts.hosts.values():
        print(f"{host.name:<9} {host.address:<15} ip netns exec {host.ns} ...")
    print(f"router grpc {address} (TLS: {cluster.certs.ca}; API key in {cluster.workdir})")
    (cluster.workdir / "api_key").write_text(cluster.api_key)
    print("ready (Ctrl-C removes everything)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        if cluster.serve is None or cluster.serve.poll() is not None:
            print("pdserve serve ended")
            return 1
    return 0


def _model(name: str) -> str:
    from engine.model_files import resolve_model_dir

    return str(resolve_model_dir(name, progress=False))


def _link(cluster, args) -> int:
    from pdserve.bench.netns.link_bench import measure_link
    from pdserve.bench.netns.ttft import measure_ttft_shares

    transports = [t for t in args.transports.split(",") if t]
    report = measure_link(cluster, args.link_rate, transports, args.repeats).to_dict()
    model = _model(args.model)
    report["ttft"] = measure_ttft_shares(cluster, model, args.prompt_tokens, args.ttft_runs)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0
