"""Microbenchmarks of this project's internals: engine, KV transfer, router overhead."""
