"""`pdserve bench`: serving, rate-sweep and KV-transfer benchmarks (see docs/BENCHMARKS.md).

Each benchmark is a module with ``add_parser(sub)`` that adds its subcommand and sets
``func``. ``register`` adds every module listed in BENCH_MODULES that exists, so a new one
(e.g. ``pdserve/bench/micro/engine.py``) joins by defining ``add_parser`` and being listed here; a
listed module that is not there yet is skipped. Callers may also pass extra registrars.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable

BENCH_MODULES = (
    "loadgen.serve",
    "loadgen.sweep",
    "loadgen.compare",
    "micro.transfer",
    "micro.engine",
    "micro.tp_decode",
    "micro.tp_transfer",
    "micro.router_overhead",
    "fidelity.cli",
    "fidelity.cpu_costs",
    "gpu_profile",
    "kernels.attention",
    "kernels.triton_quant",
    "kernels.quant_matmul",
    "kernels.cpu_variants",
    "kernels.quant",
    "kernels.isa_table",
    "report.results",
    "report.goodput_ratios",
    "report.goodput_ceiling",
    "cluster.serve_local",
    "cluster.overload_soak",
    "netns.cli",
)


def _available_modules() -> list:
    mods = []
    for name in BENCH_MODULES:
        try:
            mods.append(importlib.import_module(f"{__name__}.{name}"))
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":  # a missing dependency inside is a real error
                raise
    return mods


def register(subparsers, extra: Iterable[Callable] = ()) -> None:
    """Add a ``bench`` command with one subcommand per benchmark to ``subparsers``."""
    bench = subparsers.add_parser("bench", help="benchmarks: serve, sweep, transfer, ...")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    for module in _available_modules():
        module.add_parser(sub)
    for add in extra:
        add(sub)


class _Alone:
    """Stands in for argparse's subparsers: ``add_parser`` makes the one parser itself."""

    def add_parser(self, name: str, **kwargs):
        import argparse

        kwargs.pop("help", None)
        self.parser = argparse.ArgumentParser(prog=f"pdserve bench {name}", **kwargs)
        return self.parser


def run_alone(add_parser: Callable, argv: list[str] | None = None) -> int:
    """``python -m pdserve.bench.<pkg>.<module> ...``: one benchmark's subcommand without
    importing the others, so a GPU image without the serving dependencies runs the kernel
    benchmarks (scripts/gpu_check.sh)."""
    alone = _Alone()
    add_parser(alone)
    args = alone.parser.parse_args(argv)
    return args.func(args)


def main(argv: list[str] | None = None) -> int:
    """``python -m pdserve.bench ...``: the same subcommands without the pdserve CLI."""
    import argparse

    parser = argparse.ArgumentParser(prog="pdserve")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(argv if argv is not None else __import__("sys").argv[1:])])
    return args.func(args)
