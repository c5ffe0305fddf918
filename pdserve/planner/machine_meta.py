"""What a profile records of where it was measured: the CPU (and GPU), threads, the weights'
dtype, the versions and the commit, the date."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from kernels.cpu_extension import cpu_model, cpuinfo

# The instruction sets the CPU kernels choose between (a VM's "model name" can be bare).
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16")


def cpu_identity() -> dict:
    """The first CPU's name, family / model numbers and the ISA_FLAGS it has (Linux)."""
    fields = cpuinfo()
    flags = set(fields.get("flags", "").split())
    return {
        "name": cpu_model(),
        "family": fields.get("cpu family"),
        "model": fields.get("model"),
        "isa": [f for f in ISA_FLAGS if f in flags],
    }


def machine_meta(engine, device: str, threads: int) -> dict:
    identity = cpu_identity()
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            check=False,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else None
    weight = next(engine.runner.model.parameters())
    return {
        "cpu": identity["name"],
        "cpu_identity": identity,
        "cpu_count": os.cpu_count(),
        "gpu": gpu,
        "device": device,
        "threads": threads,
        "dtype": str(weight.dtype).removeprefix("torch."),
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "pdserve_commit": commit,
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
