"""The test suite: unit, integration, fault and end-to-end tests (``conftest.py``: fixtures)."""
