"""Tokenize and detokenize with the served model's tokenizer and chat template: vLLM's
/tokenize and /detokenize on HTTP, and Generation.Tokenize / Detokenize on gRPC, so tools count
tokens exactly as the server will."""

from __future__ import annotations

from collections.abc import Sequence

from engine.errors import InvalidRequestError
from engine.tokenizer import Tokenizer


def tokenize(
    tokenizer: Tokenizer,
    prompt: str | None,
    messages: list[dict] | None,
    add_special_tokens: bool | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of a prompt (special tokens added unless told not to) or of chat messages
    rendered with the template (which writes its own special tokens), as vLLM counts them."""
    if (prompt is None) == (messages is None):
        raise InvalidRequestError("prompt", "give exactly one of prompt or messages")
    if prompt is not None:
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens is not False)
    if not messages:
        raise InvalidRequestError("messages", "must not be empty")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt)
    except InvalidRequestError:
        raise
    except Exception as e:  # noqa: BLE001 - a template's own error on these messages
        raise InvalidRequestError("messages", f"the chat template failed: {e}") from None
    return tokenizer.encode(text, add_special_tokens=bool(add_special_tokens))


def detokenize(tokenizer: Tokenizer, tokens: Sequence[int]) -> str:
    """The text of ``tokens``, special tokens included (so it round-trips, as vLLM's)."""
    vocab = tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in tokens):
        raise InvalidRequestError("tokens", f"token ids must be in [0, {vocab})")
    return tokenizer.decode(tokens, skip_special_tokens=False)
