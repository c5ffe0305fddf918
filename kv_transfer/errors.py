"""The error a KV receiver answers with: torch-free, so the lease table (and the settings that
read its limits) load without torch."""

from __future__ import annotations


class FrameError(Exception):
    """A frame the receiver refuses; ``reason`` is safe to log and to send back."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason
