"""Attention and KV-cache kernels: a torch reference, Triton kernels and the CPU extension of each
op, one dispatch function per op (``ops.py``), and weight quantization. Imports nothing of the
project."""
