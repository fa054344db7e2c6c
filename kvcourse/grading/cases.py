"""The grading harness the stages' exercise checkers are built from: cases, a runner, and comparisons.

Each stage has its own checkers in the grading tree (``exercises/L1_contiguous/checks.py`` ..
``exercises/L6_tpu_jax/checks.py``), as tiny-llm keeps one test file per day beside its chapter. A
notebook check cell looks like this::

    # NBVAL_CHECK_OUTPUT
    checks.check_write_kv(write_kv)

and prints one line per fixed, seeded case, then a summary::

    case 1 (prefill: 5 tokens at start 0, empty cache): ok
    case 2 (decode: 1 token at start 5 after a 5-token prefill): WRONG — V differs at positions [5] (max abs diff 1.49)
    case 3 (chunk: 3 tokens at start 9, positions 0..8 filled): raised NotImplementedError: Exercise L1.1: ...
    ...
    1/5 passed

The reference notebook stores these lines as the cell's output; ``make grade`` (nbval) re-runs the cell
and compares, so every line must be deterministic: no timings, no addresses, no random draws that are
not seeded. Whatever the learner's code prints while a case runs is swallowed, so a stray debugging
``print`` in a correct function does not fail the comparison. A visible checker takes its reference
answers from its own stage's code, so the notebook shows the stage's behaviour; what the learner gets
credit for is also judged on hidden cases against an answer written apart from the stage
(``kvcourse/grading/hidden.py``, ``key/LN_*/answers.py``), and tests hold the stage and that answer
together.

This module knows no stage and imports none. It holds:

- ``Case`` and ``run_cases``: the cases and the runner that prints the lines above;
- ``tensor_problem`` / ``close_problem`` (torch, exact / within a tolerance) and ``array_problem`` /
  ``arrays_problem`` (NumPy or JAX arrays): None when a result is right, else one line saying what
  differs;
- ``outcome`` / ``describe``: one call's return value or exception, to compare with the reference's;
- ``named_mistake``: adds the broken rule to a case's line when the answer gives what a known mistake
  gives (a dropped rescale, an off-by-one, a wrong dtype);
- ``time_limit``: stops a block that runs past its seconds (main thread only);
- ``CallLimit``: stops a learner's loop that calls a method more often than allowed (instead of
  hanging);
- ``first_line`` and ``format_positions``: short texts for those lines.

Left out on purpose: partial credit, hints and clocks. A case passes or fails; a learner's infinite
loop is stopped by a call limit where one can be counted, and otherwise by ``make grade``'s time limit
per cell (clocks are not deterministic, so no printed line depends on one).
"""

from __future__ import annotations

import contextlib
import io
import signal
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    """One graded case: a fixed description and a check that returns None (ok) or what is wrong."""

    name: str
    run: Callable[[], str | None]


def run_cases(cases: Iterable[Case]) -> tuple[int, int]:
    """Run each case, print one line per case and a summary; return (passed, total).

    An exception inside a case fails that case only (its type and first line are printed) and the
    next case still runs. What a case prints itself (a learner's debugging ``print``) is captured and
    dropped: only the graded lines appear. Example::

        >>> run_cases([Case("one plus one", lambda: None if 1 + 1 == 2 else "not 2"),
        ...            Case("stub", lambda: int("x"))])
        case 1 (one plus one): ok
        case 2 (stub): raised ValueError: invalid literal for int() with base 10: 'x'
        1/2 passed
        (1, 2)
    """
    passed = total = 0
    for total, case in enumerate(cases, start=1):
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # the learner's prints, dropped
                problem = case.run()
        except Exception as e:  # the learner's code may raise anything; report it and go on
            verdict = f"raised {type(e).__name__}: {first_line(str(e))}"
        else:
            verdict = "ok" if problem is None else f"WRONG — {problem}"
        passed += verdict == "ok"
        print(f"case {total} ({case.name}): {verdict}")
    print(f"{passed}/{total} passed")
    return passed, total


def first_line(message: str, width: int = 100) -> str:
    """The first line of a message, cut to ``width`` characters.

    Examples: ``"a\\nb" -> "a"``; ``"" -> "(no message)"``.
    """
    line = message.strip().splitlines()[0] if message.strip() else "(no message)"
    return line if len(line) <= width else line[: width - 3] + "..."


def format_positions(rows: torch.Tensor) -> str:
    """Compact list of row indices: ``tensor([5, 6, 7]) -> '[5, 6, 7]'``; ``arange(10) -> '[0, 1, ..., 9]'``."""
    idx = rows.tolist()
    return str(idx) if len(idx) <= 6 else f"[{idx[0]}, {idx[1]}, ..., {idx[-1]}]"


def tensor_problem(what: str, expected: torch.Tensor, got: torch.Tensor) -> str | None:
    """None if ``got`` equals ``expected`` exactly, else which rows (dim 0) differ and by how much.

    Example: ``tensor_problem("K", zeros(4, 2), ones(4, 2))`` ->
    ``'K differs at positions [0, 1, 2, 3] (max abs diff 1)'``.
    """
    if not isinstance(got, torch.Tensor):
        return f"{what} is a {type(got).__name__}, not a tensor"
    if got.shape != expected.shape:
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    if torch.equal(got, expected):
        return None
    diff = (got.float() - expected.float()).abs()  # same shape as expected
    rows = torch.nonzero(diff.flatten(1).amax(dim=1) > 0).flatten()  # rows holding a difference
    if rows.numel() == 0:  # only NaNs differ
        return f"{what} differs (NaN)"
    return (
        f"{what} differs at positions {format_positions(rows)} (max abs diff {diff.nan_to_num().max():.3g})"
    )


def close_problem(what: str, expected: torch.Tensor, got: torch.Tensor, atol: float = 2e-5) -> str | None:
    """None if ``got`` is within ``atol`` of ``expected`` everywhere, else which rows (dim 0) are off.

    For float results whose summation order may differ from the reference's (online softmax against
    dense softmax). NaN counts as wrong. Example: ``close_problem("out", zeros(3, 2), full((3, 2), 1e-6))``
    -> None; with ``ones(3, 2)`` -> ``'out differs at positions [0, 1, 2] (max abs diff 1)'``.
    """
    if not isinstance(got, torch.Tensor):
        return f"{what} is a {type(got).__name__}, not a tensor"
    if got.shape != expected.shape:
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    diff = (got.float() - expected.float()).abs().nan_to_num(nan=float("inf"))  # NaN -> inf: always off
    per_row = diff.flatten(1).amax(dim=1) if diff.dim() > 1 else diff.reshape(-1)  # (rows,)
    rows = torch.nonzero(per_row > atol).flatten()
    if rows.numel() == 0:
        return None
    worst = diff.max()
    shown = "NaN or inf" if torch.isinf(worst) else f"{worst:.3g}"
    return f"{what} differs at positions {format_positions(rows)} (max abs diff {shown})"


def array_problem(what: str, expected, got) -> str | None:
    """None if ``got`` (any array-like) equals ``expected`` (a NumPy array) exactly, else what differs.

    Example: ``array_problem("seq_lens", np.array([4, 5]), [4, 6])`` ->
    ``'seq_lens is [4, 6], expected [4, 5]'``.
    """
    import numpy as np

    if got is None:
        return f"{what} is None"
    try:
        got = np.asarray(got)
    except Exception:  # noqa: BLE001 - anything that is not array-like
        return f"{what} is a {type(got).__name__}, not an array"
    if got.shape != expected.shape:
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    if np.array_equal(got.astype(expected.dtype), expected):
        return None
    return f"{what} is {got.tolist()}, expected {expected.tolist()}"


def arrays_problem(names, expected, got) -> str | None:
    """The first problem in a returned tuple of arrays, compared name by name; None when all match.

    Example: ``arrays_problem(("a",), [np.zeros(2)], 5)`` -> ``"returned int, expected 1 arrays"``.
    """
    if not isinstance(got, list | tuple) or len(got) != len(names):
        return f"returned {type(got).__name__}, expected {len(names)} arrays"
    for name, want, have in zip(names, expected, got, strict=True):
        problem = array_problem(name, want, have)
        if problem:
            return problem
    return None


def outcome(fn: Callable, *args) -> tuple[str, object]:
    """("ok", return value) or ("raised", the exception) for one call; never raises.

    Example: ``outcome(int, "7") -> ("ok", 7)``; ``outcome(int, "x") -> ("raised", ValueError(...))``.
    """
    try:
        return "ok", fn(*args)
    except Exception as e:  # compared with what the reference raised
        return "raised", e


def describe(result: tuple[str, object]) -> str:
    """An ``outcome`` in words: ``("ok", [0, 1]) -> 'returned [0, 1]'``; ``("raised", ValueError())`` ->
    ``'raised ValueError'``. Only the exception's type is named: its message may differ between learner
    and reference.
    """
    kind, value = result
    return f"raised {type(value).__name__}" if kind == "raised" else f"returned {value!r}"


def named_mistake(
    problem: str | None, got, mistakes: dict[str, Callable[[], object]], same=None
) -> str | None:
    """``problem`` with the rule it breaks added, when ``got`` is what a known mistake gives.

    ``mistakes`` maps a rule, in the words a learner should read (``"acc is not rescaled when the
    running max changes"``), to a function that computes what the mistake gives on the same input.
    ``same(a, b)`` compares two results (default ``==``; ``torch.equal`` or ``torch.allclose`` for
    tensors). A mistake that raises, or a ``problem`` that is None, adds nothing.

    Example: ``named_mistake("got 5, expected 6", 5, {"off by one: the last position is left out":
    lambda: 5})`` -> ``"got 5, expected 6 (off by one: the last position is left out)"``.
    """
    if problem is None:
        return None
    same = same or (lambda a, b: a == b)
    for rule, compute in mistakes.items():
        try:
            if same(compute(), got):
                return f"{problem} ({rule})"
        except Exception:  # noqa: BLE001, S112 - a mistake that cannot run on this input names nothing
            continue
    return problem


@contextlib.contextmanager
def time_limit(seconds: int, error: Exception):
    """Raise ``error`` in the block once it has run ``seconds`` (a loop that would never end, a hidden
    case that runs too long). Main thread only: elsewhere the block runs without a limit.

    Example: ``with time_limit(5, TimeoutError("compute each row directly")): ring(10**15)``.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise error

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class CallLimit:
    """A wrapper that passes everything through to ``target`` but lets ``method`` run at most ``limit``
    times; one call more raises RuntimeError. A learner's loop that does not stop fails its case instead
    of hanging the notebook.

    Example: ``CallLimit(engine, "decode_step", 4, "does the loop stop at max_new_tokens?")``: the fifth
    ``decode_step`` raises "decode_step called more than 4 times: does the loop stop at max_new_tokens?".
    """

    def __init__(self, target, method: str, limit: int, hint: str):
        self._target, self._method, self._limit, self._hint = target, method, limit, hint
        self.calls = 0

    def __getattr__(self, name: str):
        attr = getattr(self._target, name)
        if name != self._method:
            return attr

        def counted(*args, **kwargs):
            self.calls += 1
            if self.calls > self._limit:
                raise RuntimeError(f"{name} called more than {self._limit} times: {self._hint}")
            return attr(*args, **kwargs)

        return counted
