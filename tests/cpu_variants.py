"""The CPU kernel variants as pytest parameters: every build of the extension this CPU can run
(the AVX2 build too on an AVX-512 CPU) and the torch path. A test that takes one of these
fixtures runs once per variant, with every ``cpu_extension.load()`` of the code under test
answering with that variant's module (None for torch)."""

from __future__ import annotations

import pytest

from kernels import cpu_extension


def _params(names) -> list:
    runnable = cpu_extension.runnable_variants()
    return [
        pytest.param(
            name,
            id=name,
            marks=[]
            if name == cpu_extension.TORCH or name in runnable
            else [pytest.mark.skip(reason=f"this CPU lacks the {name} instructions")],
        )
        for name in names
    ]


BUILDS = _params(v.name for v in cpu_extension.VARIANTS)
ALL = _params(cpu_extension.CHOICES)


def route_loads(monkeypatch, name: str):
    """Make ``cpu_extension.load()`` return ``name``'s module (None for torch); returns it."""
    real = cpu_extension.load
    module = real(name)
    if module is None and name != cpu_extension.TORCH:
        pytest.skip(f"the {name} build of the CPU extension failed (no compiler?)")
    monkeypatch.setattr(cpu_extension, "load", lambda variant=None: real(variant or name))
    return module


@pytest.fixture(params=BUILDS)
def ext(request, monkeypatch):
    """Each compiled build in turn (AVX-512, AVX2)."""
    return route_loads(monkeypatch, request.param)


@pytest.fixture(params=ALL)
def cpu_variant(request, monkeypatch) -> str:
    """Each build in turn, then the torch path; the variant's name."""
    route_loads(monkeypatch, request.param)
    return request.param
