"""Every smoke script, as a learner runs it: on prompt files nobody here wrote, on bad input, and
against engines that are wrong on purpose (so a passing smoke means something).

- every stage's smoke on a tiny checkpoint and a prompt file with a 300+ token prompt and odd
  max_new_tokens: the configurations that need a tight pool size it from these prompts, and still preempt;
- bad input (a malformed or empty prompt file, an unknown key, a missing model folder, a prompt over
  the context limit, max_new_tokens below 1) gives one ``error: ...`` line and exit status 2, tested in
  process for each case and once per script in a fresh process (no traceback);
- ``smoke_main`` returns 1 when an engine writes a wrong token, returns too few outputs, or stops short.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from smoke_runs import run_smoke_in_process

from kvcourse.harness.smoke import StageRun, smoke_main
from kvcourse.harness.stages import STAGES
from kvcourse.stats import EngineStats

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {stage: ROOT / folder / f"{stage.lower()}_smoke.py" for stage, folder in STAGES.items()}
LONG_TEXT = " ".join(f"word{i}" for i in range(160))  # ~320 tokens with this tokenizer


def write_jsonl(path: Path, objects: list) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objects), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def long_prompts(tmp_path_factory, model_dir):
    """A 300+ token raw-text prompt among short ones, with per-prompt max_new_tokens of 1 to 24.

    Every max_new_tokens but one is above the block size (16), so each of those sequences grows into a new
    block before any of them finishes: in the tight pools (every prompt fits, their growth does not)
    the scheduler has to preempt. The max_new_tokens=1 prompt finishes at its prefill.
    """
    from kvcourse.harness.prompts import Prompt, encode, load_tokenizer

    assert len(encode(load_tokenizer(model_dir), Prompt(text=LONG_TEXT))) >= 300
    return write_jsonl(
        tmp_path_factory.mktemp("prompts") / "long.jsonl",
        [
            {"text": LONG_TEXT, "max_new_tokens": 24},
            {"messages": [{"role": "user", "content": "Hi"}], "max_new_tokens": 20},
            {"text": "The KV cache", "max_new_tokens": 1},
            {"messages": [{"role": "user", "content": "Name a prime."}], "max_new_tokens": 21},
        ],
    )


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STAGES))
def test_every_smoke_runs_a_long_prompt_file_on_any_checkpoint(stage, long_prompts, tiny_qwen3_dir, capsys):
    status = run_smoke_in_process(
        stage, ["--model", str(tiny_qwen3_dir), "--prompts", str(long_prompts), "--max-new-tokens", "5"]
    )
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert status == 0, out[-4000:]
    match = re.match(rf"{stage} smoke: (\d+)/(\d+) prompts match", last)
    assert match and match[1] == match[2] and int(match[2]) >= 4, last
    if stage in ("L3", "L4", "L5"):  # their small pools, sized from these prompts, still preempt
        assert re.search(r"small pool .*\n  cpu, .*\n  .*; \d+ steps, [1-9]\d* preemptions", out), out[-4000:]


def bad_cases(tmp: Path, tiny: Path) -> list[tuple[str, list[str], str]]:
    """(what, argv, a regex the error line must match): each names the value and, where there is one,
    the limit."""
    ok = write_jsonl(tmp / "ok.jsonl", [{"text": "hello"}])
    return [
        (
            "malformed JSON",
            ["--prompts", str(_text(tmp / "bad.jsonl", "{not json\n"))],
            r"bad\.jsonl:1: not valid JSON",
        ),
        ("empty file", ["--prompts", str(_text(tmp / "empty.jsonl", "\n"))], r"empty\.jsonl: no prompts"),
        (
            "unknown key",
            ["--prompts", str(write_jsonl(tmp / "key.jsonl", [{"text": "a", "max_tokens": 3}]))],
            r"key\.jsonl:1: unknown key 'max_tokens' \(allowed: messages, text, max_new_tokens\)",
        ),
        (
            "max_new_tokens zero in the file",
            ["--prompts", str(write_jsonl(tmp / "zero.jsonl", [{"text": "a", "max_new_tokens": 0}]))],
            r"max_new_tokens must be a positive integer, got 0",
        ),
        (
            "max_new_tokens below 1 on the command line",
            ["--prompts", str(ok), "--max-new-tokens", "-3"],
            r"--max-new-tokens must be >= 1, got -3",
        ),
        ("missing prompt file", ["--prompts", str(tmp / "nowhere.jsonl")], r"nowhere\.jsonl does not exist"),
        ("missing model folder", ["--model", str(tmp / "no-model"), "--prompts", str(ok)], r"no-model"),
        (
            "prompt over the context limit",
            ["--prompts", str(write_jsonl(tmp / "huge.jsonl", [{"text": " ".join(["word"] * 2100)}]))],
            r"prompt 1: \d+ prompt tokens \+ max_new_tokens 64 = \d+ exceeds the model's context limit "
            r"\(max_position_embeddings=2048\)",
        ),
    ]


def _text(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_bad_input_is_one_error_line_and_exit_2(tmp_path, tiny_llama_dir, capsys):
    for what, argv, pattern in bad_cases(tmp_path, tiny_llama_dir):
        if "--model" not in argv:
            argv = ["--model", str(tiny_llama_dir), *argv]
        status = run_smoke_in_process("L1", argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert status == 2, what
        assert len(err) == 1 and err[0].startswith("error: "), (what, err)
        assert re.search(pattern, err[0]), (what, err[0])


@pytest.mark.parametrize("stage", list(STAGES))
def test_every_script_refuses_a_malformed_file_without_a_traceback(stage, tmp_path, tiny_llama_dir):
    bad = _text(tmp_path / "bad.jsonl", '{"text": "a"}\n[1, 2]\n')
    res = subprocess.run(
        [sys.executable, str(SCRIPTS[stage]), "--model", str(tiny_llama_dir), "--prompts", str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: "), res.stderr
    assert "bad.jsonl:2: need exactly one of 'messages' or 'text'" in res.stderr, res.stderr


class Broken:
    """L1's engine with one fault added to its outputs, to show that the smoke notices."""

    def __init__(self, model_dir, fault: str, max_model_len: int):
        from L1_contiguous.engine import Engine

        self.engine, self.fault = Engine(model_dir, max_model_len=max_model_len), fault

    def generate(self, prompts, max_new_tokens):
        out = self.engine.generate(prompts, max_new_tokens)
        if self.fault == "wrong token":
            out[-1][0] = (out[-1][0] + 1) % 49152
        elif self.fault == "too few outputs":
            out = out[:-1]
        elif self.fault == "short output":
            out[-1] = out[-1][:-1]
        return out

    def stats(self) -> EngineStats:
        return self.engine.stats()


@pytest.mark.parametrize("fault", ["wrong token", "too few outputs", "short output"])
def test_smoke_fails_an_engine_that_is_wrong(fault, tiny_llama_dir, tmp_path, capsys):
    prompts = write_jsonl(
        tmp_path / "p.jsonl", [{"text": "abc"}, {"text": "The KV cache stores", "max_new_tokens": 4}]
    )

    def runs(ctx):
        return [StageRun(f"broken: {fault}", lambda ctx: Broken(ctx.model_dir, fault, ctx.max_model_len))]

    status = smoke_main("LX", runs, argv=["--model", str(tiny_llama_dir), "--prompts", str(prompts)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert status == 1, last
    assert re.match(r"LX smoke: [01]/2 prompts match HF", last), last


def test_the_cli_answers_bad_input_the_same_way(tmp_path, tiny_llama_dir, capsys):
    """``python -m kvcourse generate`` with the smoke's bad-input cases: exit 2, one error line."""
    from kvcourse.harness.cli import main

    for what, argv, pattern in bad_cases(tmp_path, tiny_llama_dir):
        if "--model" not in argv:
            argv = ["--model", str(tiny_llama_dir), *argv]
        status = main(["generate", "--stage", "L1", *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert status == 2, what
        assert len(err) == 1 and err[0].startswith("error: "), (what, err)
        assert re.search(pattern, err[0]), (what, err[0])
