"""``pdserve serve [MODEL]``'s operator flags (vLLM's names where they share one), and the one
function that lays them over the cluster YAML: ``apply_serve_args``.

Each flag given overrides its config field; a flag not given leaves the YAML's value; the result
is validated by the config's own pydantic model, and an error names the flag that caused it
(``FlagError``; the CLI prints it the way argparse does and exits 2). Torch-free and light: the
CLI builds this parser for every ``pdserve`` command.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from engine.config import KV_DTYPES, WEIGHT_FORMATS
from grpc_plumbing.tracing import add_tracing_arg
from kv_transfer.transports import WORKER_TRANSPORTS

API_KEY_ENV = "PDSERVE_API_KEY"  # router/app.py reads the same variable
EMBEDDED = "embedded"
# flag -> (argparse dest, the config field it sets, as the config's errors spell it)
FIELDS = {
    "MODEL": ("model", "model"),
    "--prefill": ("prefill", "pools.prefill"),
    "--decode": ("decode", "pools.decode"),
    "--kv-transport": ("kv_transport", "kv_transport"),
    "--host": ("host", "host"),
    "--port": ("port", "http_port"),
    "--grpc-port": ("grpc_port", "grpc_port"),
    "--api-key": ("api_key", "api_key"),
    "--max-model-len": ("max_model_len", "max_model_len"),
    "--weights": ("weights", "weights"),
    "--kv-dtype": ("kv_dtype", "kv_dtype"),
    "--served-model-name": ("served_model_name", "model_name"),
    "--otlp-traces-endpoint": ("otlp_traces_endpoint", "otlp_traces_endpoint"),
}
_POOL_HELP = "%s workers to start (the pool's min..max widen to include it where the YAML's do not)"


class FlagError(ValueError):
    """A flag whose value the config refuses; ``flag`` is None when no one flag is to blame."""

    def __init__(self, flag: str | None, message: str):
        super().__init__(f"argument {flag}: {message}" if flag else message)
        self.flag = flag
        self.message = message


def tensor_parallel(value: str) -> tuple[int, int]:
    """``K`` (both pools) or ``P:D`` (prefill:decode), each a positive integer."""
    parts = value.split(":")
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        sizes = []
    if len(parts) not in (1, 2) or len(sizes) != len(parts) or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected K or P:D, positive integers; got {value!r}")
    return (sizes[0], sizes[-1])


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The operator flags; each defaults to None: not given, the YAML's value stands."""
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model to serve: a Hugging Face folder, a .gguf file, or 'embedded' "
        "(default: the config's model)",
    )
    g = p.add_argument_group("serving (each overrides the config)")
    g.add_argument("--host", default=None, help="Host name (bind address).")
    g.add_argument("--port", type=int, default=None, help="Port number (HTTP, OpenAI API).")
    g.add_argument("--grpc-port", type=int, default=None, help="Port number (gRPC API).")
    g.add_argument(
        "--api-key",
        default=None,
        help="If provided, the server will require this key to be presented in the header "
        f"(default: ${API_KEY_ENV} when the config sets none; prefer the variable: a command "
        "line is visible to other users).",
    )
    g.add_argument("--served-model-name", default=None, help="The model name used in the API.")
    g.add_argument("--max-model-len", type=int, default=None, help="Model context length.")
    g = p.add_argument_group("disaggregation (each overrides the config)")
    g.add_argument("--prefill", type=int, default=None, metavar="N", help=_POOL_HELP % "prefill")
    g.add_argument("--decode", type=int, default=None, metavar="M", help=_POOL_HELP % "decode")
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=tensor_parallel,
        default=None,
        metavar="K|P:D",
        help="Number of tensor parallel replicas: ranks per worker, both pools (K) or each "
        "(P:D, prefill:decode); each must divide the model's heads.",
    )
    g.add_argument(
        "--kv-transport",
        choices=WORKER_TRANSPORTS,
        default=None,
        help="how the KV cache moves from prefill to decode workers",
    )
    g.add_argument(
        "--kv-dtype",
        "--kv-cache-dtype",
        choices=KV_DTYPES,
        default=None,
        help="Data type for kv cache storage.",
    )
    g.add_argument(
        "--weights", choices=WEIGHT_FORMATS, default=None, help="weight format, quantized at load"
    )
    g = p.add_argument_group("observability (overrides the config)")
    add_tracing_arg(g)


def apply_serve_args(cfg, args: argparse.Namespace, environ=os.environ):
    """``cfg`` (a ``ClusterConfig``) with every serve flag in ``args`` that was given, validated
    by the config's model. Raises ``FlagError`` naming the flag a bad value came from."""
    from pdserve.config import ConfigError, validate_config

    _check_model(getattr(args, "model", None))
    data, given = cfg.model_dump(), []
    for flag, (dest, field) in FIELDS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        given.append((flag, field))
        if field.startswith("pools."):
            data["pools"][dest] = _pool_with(data["pools"][dest], value)
        else:
            data[field] = value
    given += _with_tensor_parallel(data, getattr(args, "tensor_parallel_size", None))
    if not data.get("api_key") and environ.get(API_KEY_ENV):
        data["api_key"] = environ[API_KEY_ENV]  # the router actor may not see the variable
    try:
        return validate_config(data, "the serve flags over the config")
    except ConfigError as e:
        raise _blame(str(e), given) from None


def _pool_with(pool: dict, replicas: int) -> dict:
    if replicas < 1:  # left to the config to refuse, by its own words
        return {**pool, "replicas": replicas}
    return {
        **pool,
        "replicas": replicas,
        "min": min(pool["min"], replicas),
        "max": max(pool["max"], replicas),
    }


def _blame(message: str, given: list[tuple[str, str]]) -> FlagError:
    """The config's error, pinned on the flag whose field it names (first match)."""
    lines = message.splitlines()[1:] or [message]
    # The most specific field first: pools.decode.tensor_parallel_size before pools.decode.
    given = sorted(given, key=lambda g: -len(g[1]))
    for line in lines:
        for flag, field in given:
            if line.startswith((f"{field}:", f"{field}.", f"{field} ")):
                return FlagError(flag, line)
    return FlagError(None, "; ".join(lines))


def _with_tensor_parallel(data: dict, sizes: tuple[int, int] | None) -> list[tuple[str, str]]:
    """Set each pool's tensor_parallel_size from ``--tensor-parallel-size`` (prefill, decode);
    returns the fields it set, for ``_blame``."""
    if sizes is None:
        return []
    given = []
    for role, size in zip(("prefill", "decode"), sizes):
        data["pools"][role] = {**data["pools"][role], "tensor_parallel_size": size}
        given.append(("--tensor-parallel-size", f"pools.{role}.tensor_parallel_size"))
    return given


def _check_model(model: str | None) -> None:
    if model is None or model == EMBEDDED:
        return
    path = Path(model).expanduser()
    if not path.exists():
        raise FlagError("MODEL", f"no such file or folder: {model} (or give 'embedded')")
    if path.is_file() and path.suffix != ".gguf":
        raise FlagError("MODEL", f"{model} is a file but not a .gguf")
    if path.is_dir() and not (path / "config.json").is_file():
        raise FlagError("MODEL", f"{model} has no config.json (not a Hugging Face folder)")
