"""Command line: ``python -m kvcourse prepare`` and ``python -m kvcourse generate``.

    python -m kvcourse prepare                       # convert the bundled model and build the stages'
                                                     # C++ kernels, once (idempotent; resumes after
                                                     # an interrupted one)
    python -m kvcourse generate --stage L1 "What is a KV cache?"
    python -m kvcourse generate --stage L1 --prompts kvcourse/harness/prompts.jsonl --max-new-tokens 32
    python -m kvcourse generate --stage L4 --device cuda "What is a KV cache?"
    python -m kvcourse generate --stage L5 --num-beams 4 "What is a KV cache?"

``generate`` prints each prompt's generated text, then the tokens/s, how the engine was set up (device,
kernel, pool and batch sizes) and its statistics (the KV pool against the memory that held live
tokens, blocks, steps). ``--device`` defaults to ``$KVCOURSE_DEVICE``, else the CPU. Bad input (a
malformed prompt file, a missing model folder, a prompt longer than the model's context, a device this
machine does not have, ``--num-beams`` below 1 or on a stage without beam search, a width the pool
cannot hold) is one ``error: ...`` line and exit status 2. ``--num-beams K`` prints each prompt's best
hypothesis of a beam search of width K, as HF ``generate(num_beams=K)`` finds it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from kvcourse.config import ModelConfig
from kvcourse.cpp_kernels import build_all
from kvcourse.devices import add_device_argument, device_argument
from kvcourse.harness.prompts import Prompt, encode, load_tokenizer, max_new_tokens_of, read_prompts
from kvcourse.harness.stages import STAGES, engine_class
from kvcourse.limits import DEFAULT_MAX_MODEL_LEN, check_context
from kvcourse.model_store import MODEL_ENV, REPO_ROOT, cache_root, prepare_default_model, resolve_model_dir


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvcourse", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser(
        "prepare", help="convert the bundled GGUF into the cached fp32 model; build the stages' C++ kernels"
    )
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
        "--num-beams", type=int, default=1, help="beam search of this width (L5; default 1: greedy)"
    )
    gen.add_argument(
        "--model", help=f"local HF Llama/Qwen3 directory (default: ${MODEL_ENV} or the course model)"
    )
    add_device_argument(gen)
    args = parser.parse_args(argv)
    if args.command == "generate" and not (args.prompt or args.prompts):
        parser.error("give a prompt or --prompts FILE")
    return args


def generate(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.num_beams < 1:
        raise ValueError(f"--num-beams must be >= 1, got {args.num_beams}")
    if args.num_beams > 1 and args.ignore_eos:
        raise ValueError(
            f"--num-beams {args.num_beams} stops on eos as HF's beam search does: drop --ignore-eos"
        )
    device = device_argument(args.device)
    prompts = read_prompts(args.prompts) if args.prompts else []
    for text in args.prompt:
        prompts.append(Prompt(text=text) if args.raw else Prompt(messages=(("user", text),)))
    model_dir = resolve_model_dir(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    limit = cfg.max_position_embeddings
    tok = load_tokenizer(model_dir)
    ids = [encode(tok, p) for p in prompts]
    max_new = max_new_tokens_of(prompts, args.max_new_tokens)
    longest = check_context(ids, max_new, cfg)
    engine = engine_class(args.stage)(
        model_dir, device or "cpu", max_model_len=max(min(DEFAULT_MAX_MODEL_LEN, limit), longest)
    )
    if args.num_beams > 1 and not hasattr(engine, "generate_beams"):
        raise ValueError(f"--num-beams {args.num_beams}: stage {args.stage} has no beam search (L5 has)")
    t0 = time.perf_counter()
    if args.num_beams > 1:
        outputs = [best for [best] in engine.generate_beams(ids, max_new, num_beams=args.num_beams)]
    else:
        outputs = engine.generate(ids, max_new, ignore_eos=args.ignore_eos)
    seconds = time.perf_counter() - t0
    for prompt, out in zip(prompts, outputs, strict=True):
        print(f"> {prompt.label}")
        print(tok.decode(out, skip_special_tokens=True).strip())
        print()
    n = sum(map(len, outputs))
    stats = engine.stats()
    print(f"{args.stage}: {n} new tokens in {seconds:.2f} s ({n / seconds:.1f} tokens/s)")
    print(f"{args.stage}: {stats.describe()}")
    print(f"{args.stage}: {stats}")


def drop_broken_jax_entries(folder: Path) -> list[Path]:
    """Delete the entries of JAX's compilation cache in ``folder`` that JAX cannot read; return them.

    JAX writes an entry (``<function>-<key>-cache``, compressed) in place, and never again once it exists:
    a process killed while writing one (Ctrl-C in ``make test``) leaves it cut short, and every later run
    that compiles the same function fails to read it, warns ("Error reading persistent compilation cache
    entry for 'jit__decode_fn': error: Error -5 while decompressing data: incomplete or truncated
    stream") and compiles again. Deleted, it is written whole by the next run that compiles it. Every
    entry is decompressed as JAX reads it; they are small (0.1 MB for an L6 engine's decode step).
    Example: ``jit__decode_fn-86939b1e...-cache`` cut to 100 bytes -> deleted, and in the list.
    """
    entries = sorted(folder.glob("*-cache")) if folder.is_dir() else []
    if not entries:
        return []
    from jax._src.compilation_cache import decompress_executable  # JAX's own way of reading one back

    broken = []
    for entry in entries:
        try:
            decompress_executable(entry.read_bytes())
        except Exception:  # zlib's or zstd's error on a cut stream, as JAX's own read gets
            broken.append(entry)
            entry.unlink(missing_ok=True)
            entry.with_name(entry.name.removesuffix("-cache") + "-atime").unlink(missing_ok=True)
    return broken


def prepare(force: bool) -> None:
    """``python -m kvcourse prepare``: each step finds what an earlier, interrupted run left and goes on
    from there (the model conversion and the kernel builds: their modules' docstrings; JAX's cache:
    ``drop_broken_jax_entries``, in ``$JAX_COMPILATION_CACHE_DIR``, which make test and make smoke set,
    else ``.cache/jax``)."""
    print(prepare_default_model(force=force))
    for source, now, seconds, problem in build_all(REPO_ROOT):
        if problem:
            print(f"{source.relative_to(REPO_ROOT)}: NOT BUILT. {problem}. The course runs without "
                  f"it: the smokes and tests skip its runs and make bench uses the PyTorch kernel.")  # fmt: skip
            continue
        took = f"built in {seconds:.0f} s" if now and seconds is not None else "already built"
        print(f"{source.relative_to(REPO_ROOT)}: {took}, cached in .cache/kernels/")
    jax_cache = Path(os.environ.get("JAX_COMPILATION_CACHE_DIR") or cache_root() / "jax")
    if broken := drop_broken_jax_entries(jax_cache):
        print(f"note: removed half-written JAX compilation cache entries left by an interrupted run: "
              f"{len(broken)} in {jax_cache}", file=sys.stderr)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "prepare":
            prepare(args.force)
        else:
            generate(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
