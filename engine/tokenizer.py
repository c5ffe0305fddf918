"""Tokenizer and chat template from a model folder, without torch or transformers.

The router tokenizes too and must not import torch, so this reads ``tokenizer.json`` with the
``tokenizers`` library and renders the chat template with a sandboxed jinja2, as
``transformers`` does.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

from engine.errors import InvalidRequestError, ModelNotFoundError

# Texts from this long are encoded without holding the GIL (Tokenizer.encode).
LONG_TEXT_CHARS = 4096


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelNotFoundError(f"no tokenizer.json in {model_dir}")
        self._tok = HFTokenizer.from_file(str(path))
        cfg = _read_json(model_dir / "tokenizer_config.json")
        self.chat_template = cfg.get("chat_template")
        jinja = model_dir / "chat_template.jinja"
        if self.chat_template is None and jinja.is_file():
            self.chat_template = jinja.read_text()
        ids = _read_json(model_dir / "pdserve_tokenizer.json")
        self.bos_token_id = ids.get("bos_token_id", self._token_id(cfg.get("bos_token")))
        self.eos_token_id = ids.get("eos_token_id", self._token_id(cfg.get("eos_token")))
        self.bos_token = (
            self._tok.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        )
        self.eos_token = (
            self._tok.id_to_token(self.eos_token_id) if self.eos_token_id is not None else ""
        )
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < LONG_TEXT_CHARS:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        # encode_batch lets go of the GIL while it works (encode holds it, 0.6 s for 1 MiB):
        # a long text tokenized in a thread leaves the router's event loop free meanwhile.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` itself (structured output builds its vocabulary)."""
        return self._tok

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) or ""

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes: a byte-level BPE token (GPT-2's alphabet) or a byte-fallback
        token (``<0xNN>``) may hold part of a character, which its decoded text cannot show."""
        piece = self.id_to_token(token_id)
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            return bytes([int(piece[3:5], 16)])
        table = _bytes_of_unicode()
        if type(self._tok.decoder).__name__ == "ByteLevel" and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return self.decode([token_id], skip_special_tokens=False).encode()

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None
    ) -> str:
        """The template's text, as transformers renders it; ``tools`` (OpenAI's function
        tools) for templates that show the model what it may call (others ignore them)."""
        if not self.chat_template:
            raise InvalidRequestError("messages", "this model has no chat template")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None
    ) -> list[int]:
        # The template already writes any special tokens it wants.
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False)

    def _token_id(self, token) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return None if token is None else self._tok.token_to_id(token)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8.

    Decodes only a short window per token (vLLM's prefix/read offsets): the text of
    ``ids[prefix:]`` minus that of ``ids[prefix:read]``, so a token costs O(1), not O(output).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this are already in ``text``

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        skip = self.skip_special_tokens
        seen = self.tokenizer.decode(self.ids[self._prefix : self._read], skip)
        window = self.tokenizer.decode(self.ids[self._prefix :], skip)
        if window.endswith("\ufffd") or len(window) <= len(seen):
            return ""  # an incomplete character, or nothing visible yet
        delta = window[len(seen) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta


@functools.cache
def _bytes_of_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character standing for each byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _raise_template_error(message: str):
    raise InvalidRequestError("messages", message)
