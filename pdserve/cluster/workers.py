"""One way to build a worker, whatever hosts it: ``build_worker(role, settings)`` for the local
harness and the Ray actors, over the roles' own start functions, which ``python -m
prefill_worker`` / ``python -m decode_worker`` call too (the workers import nothing above them,
so the dispatch by role lives here, in the shell).
"""

from __future__ import annotations

from decode_worker.launch import DecodeSettings, decode_args, start_decode_worker
from engine.settings import LoadedModel
from grpc_plumbing.worker_process import RunningWorker
from prefill_worker.launch import PrefillSettings, prefill_args, start_prefill_worker

ROLE_SETTINGS = {"prefill": PrefillSettings, "decode": DecodeSettings}
_START = {"prefill": start_prefill_worker, "decode": start_decode_worker}
_ARGS = {"prefill": prefill_args, "decode": decode_args}


def build_worker(role: str, settings, loaded: LoadedModel | None = None) -> RunningWorker:
    """Build the ``role`` worker ``settings`` describe and start serving. ``loaded``: weights
    to share with other in-process workers (else the worker loads its own)."""
    _check(role, settings)
    return _START[role](settings, loaded)


def worker_args(role: str, settings) -> list[str]:
    """The command line of ``python -m <role>_worker`` for ``settings``."""
    _check(role, settings)
    return _ARGS[role](settings)


def _check(role: str, settings) -> None:
    expected = ROLE_SETTINGS.get(role)
    if expected is None:
        raise ValueError(f"unknown worker role {role!r}; expected one of {sorted(ROLE_SETTINGS)}")
    if type(settings) is not expected:
        raise TypeError(f"a {role} worker takes {expected.__name__}, not {type(settings).__name__}")
