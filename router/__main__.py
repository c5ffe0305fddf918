"""``python -m router``: the router over running workers; prints ``READY <grpc address>``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from engine.model_files import resolve_model_dir
from grpc_plumbing.tls import TlsFiles, add_cluster_tls_args, cluster_tls_from_args
from grpc_plumbing.tracing import add_tracing_arg
from router.app import start_router
from router.limits import RequestLimits
from router.security import ApiSecurity, OpenBindError
from router.settings import RouterSettings


def _addresses(text: str) -> list[str]:
    return [a for a in text.split(",") if a]


async def _serve(args) -> None:
    cfg = RouterSettings(
        model_dir=str(resolve_model_dir(args.model)),
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        kv_local_tail_tokens=args.kv_local_tail_tokens,
        concurrent_reserve_headroom=args.concurrent_reserve_headroom,
        first_token_timeout_s=args.first_token_timeout_s,
        first_token_s_per_token=args.first_token_s_per_token,
        token_timeout_s=args.token_timeout_s,
        cluster_tls=cluster_tls_from_args(args),
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        limits=RequestLimits(
            max_request_bytes=args.max_request_bytes,
            max_prompt_tokens=args.max_prompt_tokens,
            max_tokens=args.max_tokens_limit,
            max_stop_strings=args.max_stop_strings,
            max_stop_string_chars=args.max_stop_string_chars,
            max_logit_bias=args.max_logit_bias,
            max_stop_token_ids=args.max_stop_token_ids,
            max_sequences=args.max_sequences,
            max_total_tokens=args.max_total_tokens,
            max_logprobs=args.max_logprobs,
        ),
    )
    tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    security = ApiSecurity(tls, args.allow_unauthenticated, args.open_metrics)
    servers = await start_router(
        cfg,
        _addresses(args.prefill),
        _addresses(args.decode),
        args.host,
        args.port,
        args.http_port,
        api_key=args.api_key,
        security=security,
    )
    print(f"READY {servers.grpc_address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await servers.stop()


def _add_liveness_args(parser: argparse.ArgumentParser, d: RouterSettings) -> None:
    """A worker that stops answering is taken as hung, and its requests migrate."""
    add = parser.add_argument
    first = "seconds a worker may take to a first token, plus --first-token-s-per-token x "
    first += "the prompt tokens it prefills before it"
    add("--first-token-timeout-s", type=float, default=d.first_token_timeout_s, help=first)
    add("--first-token-s-per-token", type=float, default=d.first_token_s_per_token)
    gap = "seconds a Decode stream may go without a token"
    add("--token-timeout-s", type=float, default=d.token_timeout_s, help=gap)


def _add_security_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--allow-unauthenticated",
        action="store_true",
        help="serve off loopback without an API key (only behind something that authenticates)",
    )
    add("--open-metrics", action="store_true", help="serve /metrics without the API key")
    add("--tls-cert", help="PEM certificate chain: HTTPS and gRPC TLS on the client API")
    add("--tls-key", help="PEM private key of --tls-cert")
    add("--tls-client-ca", help="require client certificates signed by this CA (mutual TLS)")
    add_cluster_tls_args(parser)
    defaults = RequestLimits()
    add("--max-request-bytes", type=int, default=defaults.max_request_bytes)
    add("--max-prompt-tokens", type=int, default=None, help="default: the context")
    add("--max-tokens-limit", type=int, default=None, help="cap on max_tokens (default: context)")
    add("--max-stop-strings", type=int, default=defaults.max_stop_strings)
    add("--max-stop-string-chars", type=int, default=defaults.max_stop_string_chars)
    add("--max-logit-bias", type=int, default=defaults.max_logit_bias)
    add("--max-stop-token-ids", type=int, default=defaults.max_stop_token_ids)
    add("--max-sequences", type=int, default=defaults.max_sequences, help="n x prompts")
    add("--max-total-tokens", type=int, default=defaults.max_total_tokens)
    add("--max-logprobs", type=int, default=defaults.max_logprobs)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m router")
    parser.add_argument("--model", default="embedded", help="for the tokenizer and chat template")
    parser.add_argument("--prefill", required=True, help="comma-separated prefill worker addresses")
    parser.add_argument("--decode", required=True, help="comma-separated decode worker addresses")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--http-port", type=int, default=None)
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' (default: $PDSERVE_API_KEY); "
        "the cluster token comes from $PDSERVE_CLUSTER_TOKEN",
    )
    d = RouterSettings(model_dir="")  # the defaults, from their one home
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len)
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--prefill-policy", default=d.prefill_policy)
    parser.add_argument("--decode-policy", default=d.decode_policy)
    parser.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=d.local_prefill_max_tokens,
        help="prompts up to this many tokens are prefilled on the decode worker",
    )
    parser.add_argument(
        "--kv-local-tail-tokens",
        type=int,
        default=d.kv_local_tail_tokens,
        help="kv_aware: a decode worker whose cache holds all of a prompt but this many tokens "
        "prefills them itself",
    )
    parser.add_argument(
        "--concurrent-reserve-headroom",
        type=float,
        default=d.concurrent_reserve_headroom,
        help="reserve and prefill at once while a decode worker keeps this share of its "
        "blocks free; -1: always reserve first",
    )
    _add_liveness_args(parser, d)
    _add_security_args(parser)
    add_tracing_arg(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        asyncio.run(_serve(parser.parse_args()))
    except OpenBindError as e:  # the reason, not a traceback
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
