"""Two processes converting one GGUF file at once (a fresh machine's cluster workers all load
the embedded model on start): the one that renames its folder in second uses the first's."""

from __future__ import annotations

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


def test_a_conversion_that_lost_the_race_uses_the_winners_folder(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    root = tmp_path / "cache"

    def other_process_finishes(out: Path):
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"theirs")

    _fake_conversion(monkeypatch, other_process_finishes)
    out = gguf_convert.convert_gguf(gguf, root, progress=False)
    assert (out / "model.safetensors").read_bytes() == b"theirs"
    assert [p.name for p in root.iterdir()] == [out.name]  # its own temp folder is gone


def test_a_half_written_folder_in_the_way_is_an_error(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    root = tmp_path / "cache"

    def something_else_in_the_way(out: Path):
        out.mkdir()
        (out / "stray").write_bytes(b"")

    _fake_conversion(monkeypatch, something_else_in_the_way)
    with pytest.raises(OSError):
        gguf_convert.convert_gguf(gguf, root, progress=False)
    assert [p.name for p in root.iterdir()] == [gguf_convert.cache_dir_for(gguf, root).name]
