"""Kernel and matmul micro-benchmarks: attention, quantized matmuls, CPU variants, llama.cpp.

Each module is a ``pdserve bench`` subcommand (``attention``, ``triton-quant``,
``quant-matmul``, ``cpu-variants``, ``quant``, ``isa-table``); heavy imports (torch, Triton)
stay inside the modules, so importing the package costs nothing.
"""
