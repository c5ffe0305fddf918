"""Transport names as pytest parameters: one whose optional package is missing (nixl without
pdserve[nixl]) is skipped with the reason, not failed."""

from __future__ import annotations

import pytest

from kv_transfer.transports import transport_missing


def transport_params(names) -> list:
    return [
        pytest.param(name, marks=pytest.mark.skipif(bool(why), reason=why or ""))
        for name in names
        for why in [transport_missing(name)]
    ]


def requires_transport(name: str):
    """A mark that skips a test of transport ``name`` where it cannot run."""
    why = transport_missing(name)
    return pytest.mark.skipif(bool(why), reason=why or "")
