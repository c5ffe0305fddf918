"""The ``pdserve`` command line."""

from __future__ import annotations

import argparse
import sys

from engine.errors import PdserveError


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="complete one prompt with the local engine")
    p.add_argument("prompt", help="the user message (or raw text with --raw)")
    p.add_argument("--model", default="embedded", help="HF folder, .gguf file, or 'embedded'")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.set_defaults(func=cmd_generate)


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
    engine = LLMEngine.from_model_path(args.model)
    prompt = args.prompt
    if not args.raw and engine.tokenizer is not None and engine.tokenizer.chat_template:
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    request_id = engine.add_request(prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                print(out.new_text, end="", flush=True)
    print()
    return 0


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="run a few concurrent chat requests and print a table")
    p.add_argument("--model", default="embedded")
    p.add_argument("--max-tokens", type=int, default=48)
    p.set_defaults(func=lambda args: _run_demo(args))


def _run_demo(args) -> int:
    from pdserve.demo import run_demo

    return run_demo(args.model, args.max_tokens)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_demo(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PdserveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
