"""Several processes converting one GGUF file at once (a fresh machine's cluster workers all
load the embedded model on start): one converts while the others wait for its folder; where
two convert anyway (past the wait, or without flock), the one that renames second uses the
first's folder."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from engine import gguf_convert


def _fake_conversion(monkeypatch, before_rename):
    """Conversion that writes placeholder files; ``before_rename(out)`` runs just before the
    folder is renamed into place (where a concurrent process may finish first)."""

    def write_weights(gguf_path, tmp: Path, progress):
        (tmp / "model.safetensors").write_bytes(b"mine")
        return {}

    def write_tokenizer(gguf_path, tmp: Path, config):
        before_rename(gguf_convert.cache_dir_for(Path(gguf_path), tmp.parent))

    monkeypatch.setattr(gguf_convert, "_write_weights", write_weights)
    monkeypatch.setattr(gguf_convert, "_write_tokenizer", write_tokenizer)


def _gguf_and_cache(tmp_path: Path) -> tuple[Path, Path]:
    """A placeholder GGUF file (the fake conversion never reads it) and an empty cache root."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    return gguf, tmp_path / "cache"


def _folder_in_the_way(name: str, content: bytes):
    """What another process puts at the cache folder just before this one renames."""

    def put(out: Path):
        out.mkdir()
        (out / name).write_bytes(content)

    return put


def test_a_conversion_that_lost_the_race_uses_the_winners_folder(tmp_path, monkeypatch):
    gguf, root = _gguf_and_cache(tmp_path)
    _fake_conversion(monkeypatch, _folder_in_the_way("model.safetensors", b"theirs"))
    out = gguf_convert.convert_gguf(gguf, root, progress=False)
    assert (out / "model.safetensors").read_bytes() == b"theirs"
    assert _folders(root) == [out.name]  # its own temp folder is gone


def test_a_half_written_folder_in_the_way_is_an_error(tmp_path, monkeypatch):
    gguf, root = _gguf_and_cache(tmp_path)
    _fake_conversion(monkeypatch, _folder_in_the_way("stray", b""))
    with pytest.raises(OSError):
        gguf_convert.convert_gguf(gguf, root, progress=False)
    assert _folders(root) == [gguf_convert.cache_dir_for(gguf, root).name]


def _folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def test_concurrent_conversions_convert_once(tmp_path, monkeypatch):
    """Three loaders at once: one converts, the other two wait and return its folder."""
    gguf, root = _gguf_and_cache(tmp_path)
    conversions = []

    def write_weights(gguf_path, tmp: Path, progress):
        conversions.append(tmp)
        time.sleep(0.5)  # long enough that the others arrive meanwhile
        (tmp / "model.safetensors").write_bytes(b"weights")
        return {}

    monkeypatch.setattr(gguf_convert, "_write_weights", write_weights)
    monkeypatch.setattr(gguf_convert, "_write_tokenizer", lambda *args: None)
    outs: list[Path] = []
    loaders = [
        threading.Thread(target=lambda: outs.append(gguf_convert.convert_gguf(gguf, root, False)))
        for _ in range(3)
    ]
    for t in loaders:
        t.start()
    for t in loaders:
        t.join(timeout=30)
    assert len(conversions) == 1
    assert len(outs) == 3 and len(set(outs)) == 1
    assert (outs[0] / "model.safetensors").read_bytes() == b"weights"
    assert _folders(root) == [outs[0].name]
