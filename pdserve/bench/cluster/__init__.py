"""Benchmarks that start this project's own local cluster: a server for the shell drivers, soak.

Subcommands ``pdserve bench cluster`` (serves a Ray-less cluster's HTTP API for
scripts/benchmarks.sh and scripts/bench_compare.sh) and ``overload-soak``.
"""
