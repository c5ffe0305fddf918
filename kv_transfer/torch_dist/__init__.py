"""The torch_dist KV transport: torch.distributed point-to-point over a 2-rank group per
sender (NCCL between GPUs, gloo on CPU), registered as ``torch_dist`` in kv_transfer/transports.py.

``transport``: the sender side (``connect``, ``serve``); ``receiver``: the receiver server (a
pairing port, a thread per authenticated sender pair, capped); ``acceptor``: the pairing
port's one handshake thread; ``handshake``: the mutual token proof; ``pairstore``: the gloo/
NCCL rendezvous over the authenticated connection; ``pair``: the pair protocol both share and
its security note. This file imports nothing, so importing the package loads no torch.
"""
