"""The HTTP fuzzing of tests/test_http_fuzz.py: schemathesis requests for one operation of the
served schema and generation mode, and the checks on each answer (no 5xx; a streamed 200 ends
with ``data: [DONE]`` and carries no error event).

Also a program, so that the fuzzing runs in processes of its own beside the server (in the
test's process): generating a body costs more than the server's answer, and in one process
the two take turns on one core (the GIL) while the other core idles. Each process claims the
(operation, mode) pairs not yet claimed, one at a time (a file created exclusively per pair),
and prints the requests it sent as JSON; an assertion that fails exits it non-zero with the
traceback on stderr::

    python -m tests.http_fuzz_cases BASE_URL EXAMPLES CLAIM_DIR
"""

from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode


def fuzz_pairs(base_url: str) -> list[tuple[str, str]]:
    """Every (operation, mode) the fuzzing covers: valid requests for each operation, invalid
    bodies too for operations that take one (a POST with a body; POST /ping takes none)."""
    pairs = []
    for op in operations(base_url):
        pairs.append((op.label, GenerationMode.POSITIVE.value))
        if op.method.upper() == "POST" and len(op.body):
            pairs.append((op.label, GenerationMode.NEGATIVE.value))
    return pairs


def operations(base_url: str) -> list:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def fuzz_operation(
    op, mode: GenerationMode, examples: int, sent: collections.Counter, stream: bool = False
) -> None:
    """``examples`` generated requests of ``op`` in ``mode``, each answer checked; counts them
    in ``sent`` by (operation, mode), and the streamed 200s by ("streamed 200", operation).
    ``stream``: every generated body (a JSON object) asks for a stream."""

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def send(case):
        if stream and isinstance(case.body, dict):
            case.body["stream"] = True
        response = case.call(timeout=60)
        sent[op.label, mode.value] += 1
        assert response.status_code < 500, (
            f"{op.label} -> {response.status_code}: {response.text[:300]}\n"
            f"body: {str(case.body)[:500]}"
        )
        if check_stream(response, op.label, case.body):
            sent["streamed 200", op.label] += 1

    send()


def check_stream(response, label: str, body) -> bool:
    """A streamed 200 (an SSE body) ends with ``data: [DONE]`` and has no error event; True
    where ``response`` was one."""
    if response.status_code != 200:
        return False
    content_type = response.headers.get("content-type") or ""  # schemathesis: a list of values
    if "text/event-stream" not in str(content_type):
        return False
    text = response.text
    if getattr(response, "stream_cut_short", False):  # schemathesis: 20 events at most
        req = response.request
        text = httpx.post(req.url, content=req.body, headers=dict(req.headers), timeout=60).text
    blocks = text.replace("\r\n", "\n").split("\n\n")
    data = [
        [ln[len("data: ") :] for ln in b.split("\n") if ln.startswith("data: ")] for b in blocks
    ]
    events = ["\n".join(d) for d in data if d]
    where = f"{label}, body {str(body)[:300]}: {text[-300:]!r}"
    assert events and events[-1] == "[DONE]", f"streamed 200 without [DONE]: {where}"
    errors = [e for e in events[:-1] if '"error"' in e and "error" in json.loads(e)]
    assert not errors, f"streamed 200 with an error event: {errors[:1]} ({where})"
    return True


def _claim(claims: Path, index: int) -> bool:
    """True for the one process that claims pair ``index`` first."""
    try:
        os.close(os.open(claims / str(index), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def main(base_url: str, examples: int, claims: Path) -> None:
    by_label = {op.label: op for op in operations(base_url)}
    sent: collections.Counter = collections.Counter()
    for index, (label, mode) in enumerate(fuzz_pairs(base_url)):
        if _claim(claims, index):
            fuzz_operation(by_label[label], GenerationMode(mode), examples, sent)
    print(json.dumps([[*key, n] for key, n in sent.items()]))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
