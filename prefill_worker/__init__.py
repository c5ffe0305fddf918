"""The prefill worker: chunked prefill under a token budget with a prefix cache, run on the
shared engine, its KV handed to ``kv_transfer`` for the decode worker the router picked.

``python -m prefill_worker`` starts one (launch.py: its settings and flags); server.py is its
gRPC service, worker.py the engine loop. This file imports nothing (DESIGN.md, "Layout").
"""
