"""Command line: ``python -m kvcourse prepare`` and ``python -m kvcourse generate``.

    python -m kvcourse prepare                       # convert the bundled model once (idempotent)
    python -m kvcourse generate --stage L1 "What is a KV cache?"
    python -m kvcourse generate --stage L1 --prompts kvcourse/prompts.jsonl --max-new-tokens 32

``generate`` prints each prompt's generated text, then the tokens/s and the KV memory the stage
reserved versus the memory that held live tokens.
"""

from __future__ import annotations

import argparse
import sys
import time

from kvcourse.model_store import MODEL_ENV, prepare_default_model, resolve_model_dir
from kvcourse.prompts import Prompt, budgets, encode, load_tokenizer, read_prompts
from kvcourse.stages import STAGES, engine_class


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcourse", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="convert the bundled GGUF into the cached fp32 model")
    prep.add_argument("--force", action="store_true", help="convert again even if already prepared")
    gen = sub.add_parser("generate", help="generate text with one stage's engine")
    gen.add_argument("prompt", nargs="*", help="chat message(s), one prompt each")
    gen.add_argument("--stage", default="L1", choices=list(STAGES), help="which stage's engine (default L1)")
    gen.add_argument(
        "--prompts", help="JSONL prompt file instead of (or besides) prompts on the command line"
    )
    gen.add_argument(
        "--raw", action="store_true", help="treat command-line prompts as raw text, no chat template"
    )
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens tokens")
    gen.add_argument(
        "--model", help=f"local HF Llama/Qwen3 directory (default: ${MODEL_ENV} or the course model)"
    )
    args = parser.parse_args(argv)

    if args.command == "prepare":
        print(prepare_default_model(force=args.force))
        return 0

    prompts = read_prompts(args.prompts) if args.prompts else []
    for text in args.prompt:
        prompts.append(Prompt(text=text) if args.raw else Prompt(messages=(("user", text),)))
    if not prompts:
        parser.error("give a prompt or --prompts FILE")
    model_dir = resolve_model_dir(args.model)
    tok = load_tokenizer(model_dir)
    ids = [encode(tok, p) for p in prompts]
    engine = engine_class(args.stage)(model_dir)
    t0 = time.perf_counter()
    outputs = engine.generate(ids, budgets(prompts, args.max_new_tokens), ignore_eos=args.ignore_eos)
    seconds = time.perf_counter() - t0
    for prompt, out in zip(prompts, outputs):
        print(f"> {prompt.label}")
        print(tok.decode(out, skip_special_tokens=True).strip())
        print()
    n = sum(map(len, outputs))
    print(f"{args.stage}: {n} new tokens in {seconds:.2f} s ({n / seconds:.1f} tokens/s)")
    usage = getattr(engine, "usage", None)
    if usage is not None:
        print(f"{args.stage}: {usage}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
