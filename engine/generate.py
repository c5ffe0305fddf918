"""``generate``: complete one prompt with the local engine (``pdserve generate`` and
``python -m engine``). It lives in the engine so that ``python -m engine`` needs nothing above it."""

from __future__ import annotations

import argparse
import sys

from engine.args import device_name
from engine.errors import PdserveError


def add_generate_parser(sub) -> argparse.ArgumentParser:
    """Add the ``generate`` subcommand to ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser("generate", help="complete one prompt with the local engine")
    p.add_argument("prompt", help="the user message (or raw text with --raw)")
    p.add_argument("--model", default="embedded", help="HF folder, .gguf file, or 'embedded'")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--device", type=device_name, default="auto", help="cpu, cuda[:N], or auto")
    p.set_defaults(func=cmd_generate)
    return p


def cmd_generate(args) -> int:
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    engine = LLMEngine.from_model_path(args.model, device=args.device)
    prompt = args.prompt
    if not args.raw and engine.tokenizer is not None and engine.tokenizer.chat_template:
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    request_id = engine.add_request(prompt, params)
    error = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                print(out.new_text, end="", flush=True)
                error = out.error or error
    print()
    if error:  # the engine failed the request (finish_reason "error"), not a normal end
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m engine "prompt" [options]``: the same as ``pdserve generate``."""
    parser = argparse.ArgumentParser(prog="python -m engine")
    add_generate_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["generate", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except PdserveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
