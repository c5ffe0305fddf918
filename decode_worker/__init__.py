"""The decode worker: KV admission (leases on reserved blocks), the continuous-batching decode
loop, token streaming and preemption, on the shared engine.

``python -m decode_worker`` starts one (launch.py: its settings and flags); server.py is its
gRPC service (with the KV receiver's port), worker.py the engine loop. This file imports
nothing (DESIGN.md, "Layout").
"""
