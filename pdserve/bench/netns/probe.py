"""What runs inside one namespace host for the harness; prints one JSON line.

generate ADDRESS CA SPEC.json   prompts through the router's gRPC API (API key from
                                $PDSERVE_API_KEY, TLS trusting CA); token ids and timings
listeners                       this host's listening TCP sockets: address, port, pid
refuses SPEC.json               for each worker or KV port: a call without the cluster
                                certificate, and one with it but without the token (a
                                pairing port, nixl's control port: its handshake without it)
api SPEC.json                   the client API without TLS, without the key, with both
tcp HOST PORT                   whether a TCP connection opens (and its error)
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import grpc

WORKER_METHODS = ("/pdserve.v1.DecodeWorker/Status", "/pdserve.v1.PrefillWorker/Status")
CALL_TIMEOUT_S = 10.0


class _Streaming:
    """Prints ``{"started": true}`` once every request has ``after`` tokens (0: never), so a
    driver can act while every stream is known to be running."""

    def __init__(self, n: int, after: int):
        self.left, self.after, self.seen = n, after, set()

    def tokens(self, out) -> None:
        if self.after and out.request_id not in self.seen and len(out.token_ids) >= self.after:
            self.seen.add(out.request_id)
            self.left -= 1
            if self.left == 0:
                print(json.dumps({"started": True}), flush=True)


def generate(address: str, ca: str, spec_path: str) -> dict:
    """``spec``: prompts, max_tokens; sequential (one at a time); signal_after (see
    ``_Streaming``)."""
    from pdserve.client import AsyncClient, Completion

    spec = json.loads(Path(spec_path).read_text())

    streaming = _Streaming(len(spec["prompts"]), spec.get("signal_after", 0))

    async def run() -> list:
        client = AsyncClient(address, api_key=os.environ["PDSERVE_API_KEY"], ca=ca)

        async def one(p):
            out = Completion()
            async for chunk in client.stream(
                token_ids=p, max_tokens=spec["max_tokens"], ignore_eos=True, include_timings=True
            ):
                out.add(chunk)
                streaming.tokens(out)
            return out

        try:
            if spec.get("sequential"):  # one at a time: nothing queues behind another
                outs = [await one(p) for p in spec["prompts"]]
            else:
                outs = await asyncio.gather(*(one(p) for p in spec["prompts"]))
        finally:
            await client.close()
        return [_completion(o) for o in outs]

    return {"outputs": asyncio.run(run())}


def _completion(out) -> dict:
    t = out.timings
    return {
        "token_ids": list(out.token_ids),
        "ttft_s": t.ttft_s,
        "prefill_s": t.prefill_s,
        "kv_transfer_s": t.kv_transfer_s,
        "kv_bytes": t.kv_bytes,
        "e2e_s": t.e2e_s,
    }


def listeners() -> dict:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        fields = line.split()
        local = fields[3]
        host, port = local.rsplit(":", 1)
        pids = [int(p) for p in re.findall(r"pid=(\d+)", line)]
        names = re.findall(r'\("([^"]+)"', line)
        rows.append({"host": host.strip("[]"), "port": int(port), "pids": pids, "names": names})
    return {"listeners": rows}


def _code(call) -> str:
    try:
        call()
    except grpc.RpcError as e:
        return e.code().name
    return "OK"


def _worker_call(channel) -> str:
    """The worker Status calls (one of the two services is served); the strongest refusal."""
    codes = []
    for method in WORKER_METHODS:
        stub = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        codes.append(_code(lambda stub=stub: stub(b"", timeout=CALL_TIMEOUT_S)))
    return (
        "OK" if "OK" in codes else ("UNAUTHENTICATED" if "UNAUTHENTICATED" in codes else codes[0])
    )


def refuses(spec_path: str) -> dict:
    """``spec``: {"grpc": [addr...], "flight": [addr...], "pairing": [addr...], "ca", "cert",
    "key"}. Per grpc or flight address: the
    answer of a plaintext call, of a TLS call without a client certificate, and of a mutual-TLS
    call (the cluster's own certificate) that has no token."""
    spec = json.loads(Path(spec_path).read_text())
    ca, cert, key = (Path(spec[k]).read_bytes() for k in ("ca", "cert", "key"))
    results = {}
    for addr in spec.get("grpc", []):
        results[addr] = {
            "plaintext": _worker_call(grpc.insecure_channel(addr)),
            "tls_no_cert": _worker_call(
                grpc.secure_channel(addr, grpc.ssl_channel_credentials(ca))
            ),
            "cert_no_token": _worker_call(
                grpc.secure_channel(addr, grpc.ssl_channel_credentials(ca, key, cert))
            ),
        }
    for addr in spec.get("flight", []):
        results[addr] = _flight_refusals(addr, ca, cert, key)
    for addr in spec.get("pairing", []):
        results[addr] = _pairing_refusals(addr)
    return {"results": results}


def _pairing_refusals(addr: str) -> dict:
    """A port that pairs by the torch_dist handshake (nixl's control port): the sender's half
    run without the token; UNAUTHENTICATED when the receiver's verdict refuses the pair."""
    from kv_transfer.torch_dist.handshake import HandshakeError, pair_as_sender

    host, port = addr.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=CALL_TIMEOUT_S) as sock:
            pair_as_sender(sock, None)
    except HandshakeError as e:
        return {"no_token": "UNAUTHENTICATED" if "refused the pair" in str(e) else str(e)}
    except OSError as e:
        return {"no_token": type(e).__name__}
    return {"no_token": "OK"}


def _flight_refusals(addr: str, ca: bytes, cert: bytes, key: bytes) -> dict:
    from pyarrow import flight

    def attempt(location: str, **kw) -> str:
        try:
            client = flight.FlightClient(location, **kw)
            list(client.list_flights(options=flight.FlightCallOptions(timeout=CALL_TIMEOUT_S)))
        except flight.FlightUnauthenticatedError:
            return "UNAUTHENTICATED"
        except Exception as e:  # noqa: BLE001 - any refusal counts; its kind is reported
            return type(e).__name__
        return "OK"

    return {
        "plaintext": attempt(f"grpc+tcp://{addr}"),
        "tls_no_cert": attempt(f"grpc+tls://{addr}", tls_root_certs=ca),
        "cert_no_token": attempt(
            f"grpc+tls://{addr}", tls_root_certs=ca, cert_chain=cert, private_key=key
        ),
    }


def api(spec_path: str) -> dict:
    """The router's gRPC and HTTP APIs from here: plaintext, TLS without the key, with a wrong
    one, with it."""
    from pdserve.client import Client
    from protos import pdserve_pb2 as pb
    from protos import pdserve_pb2_grpc as pb_grpc

    spec = json.loads(Path(spec_path).read_text())
    addr, ca, key = spec["address"], spec["ca"], os.environ["PDSERVE_API_KEY"]

    def models(**kw) -> str:
        with Client(addr, **kw) as c:
            # ListModels with a deadline (Client.list_models has none)
            stub = pb_grpc.GenerationStub(c._channel)
            return _code(
                lambda: stub.ListModels(
                    pb.ListModelsRequest(), metadata=c._metadata, timeout=CALL_TIMEOUT_S
                )
            )

    return {
        "plaintext_with_key": models(api_key=key),
        "tls_without_key": models(ca=ca),
        "tls_wrong_key": models(ca=ca, api_key="sk-wrong"),
        "tls_with_key": models(ca=ca, api_key=key),
        **_http_answers(spec["http"], ca, key),
    }


def _http_answers(host_port: str, ca: str, key: str) -> dict:
    """GET /v1/models on the router's HTTP port: the status, or the error's kind."""
    import httpx

    def get(scheme: str, headers: dict) -> str:
        try:
            with httpx.Client(verify=ca, timeout=CALL_TIMEOUT_S) as c:
                return str(c.get(f"{scheme}://{host_port}/v1/models", headers=headers).status_code)
        except httpx.HTTPError as e:
            return type(e).__name__

    bearer = {"Authorization": f"Bearer {key}"}
    return {
        "http_plaintext_with_key": get("http", bearer),
        "https_without_key": get("https", {}),
        "https_wrong_key": get("https", {"Authorization": "Bearer sk-wrong"}),
        "https_with_key": get("https", bearer),
    }


def migrations(url: str, ca: str) -> dict:
    """The router's count of migrated requests, from its /metrics (HTTPS, the API key)."""
    import httpx

    key = os.environ["PDSERVE_API_KEY"]
    with httpx.Client(verify=ca, timeout=CALL_TIMEOUT_S) as c:
        text = c.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}).text
    rows = [ln for ln in text.splitlines() if ln.startswith("pdserve:request_migrations_total")]
    return {"migrations": sum(float(ln.rsplit(" ", 1)[1]) for ln in rows)}


def tcp(host: str, port: str) -> dict:
    try:
        with socket.create_connection((host, int(port)), timeout=3):
            return {"open": True, "error": ""}
    except OSError as e:
        return {"open": False, "error": type(e).__name__}


def _link(name: str):
    def run(*args):
        from pdserve.bench.netns import link_bench

        return getattr(link_bench, name)(*args)

    return run


COMMANDS = {
    "generate": generate,
    "listeners": listeners,
    "refuses": refuses,
    "api": api,
    "tcp": tcp,
    "migrations": migrations,
    **{n.replace("_", "-"): _link(n) for n in ("kv_serve", "kv_push", "tcp_sink", "tcp_send")},
}


def main(argv: list[str]) -> int:
    print(json.dumps(COMMANDS[argv[0]](*argv[1:])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
