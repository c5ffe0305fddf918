"""The torch_dist KV transport: torch.distributed point-to-point over a 2-rank group per
sender (NCCL between GPUs, gloo on CPU), registered as ``torch_dist`` in kv_transfer/transports.py.

``transport``: the sender side (``connect``, ``serve``); ``receiver``: the receiver server (a
TCPStore rendezvous, a thread per sender pair); ``pair``: the pair protocol both share and
its security note. This file imports nothing, so importing the package loads no torch.
"""
