"""L1's exercises beyond the stage (L1.4 a sliding-window ring buffer, L1.5 what contiguous caches
reserve and use), and the rules L1's checkers name (issue 37).

For each new exercise: the independent answer (``answers.py``) and the reference notebook's solution
pass the visible checker and the hidden cases of three seeds; the untouched stub fails; plausible wrong
answers fail both the visible check, with the broken rule named in the line, and the hidden cases; the
hidden cases differ from seed to seed. The data the visible checker keeps for cases no simulation reaches
(L1.4's huge lengths) equals what the answer gives. No model is loaded: everything runs on small lists.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from checker_asserts import assert_fails, assert_passes, graded_lines, hidden_problems

from exercises.L1_contiguous import checks
from key.L1_contiguous import answers
from kvcourse.grading import exercises, hidden

NOTEBOOK = Path(__file__).resolve().parent.parent / "key" / "notebooks" / "L1_contiguous.ipynb"
SEEDS = (0, 1, 2)


def solution(name: str):
    """The function ``name`` as the reference notebook's solution cell defines it."""
    nb = exercises.read(NOTEBOOK)
    (source,) = [c.source for c in nb.cells if c.cell_type == "code" and f"def {name}(" in c.source]
    namespace: dict = {}
    exec(compile(source, f"{NOTEBOOK.name}:{name}", "exec"), namespace)  # noqa: S102
    return namespace[name]


def stub(*args):
    raise NotImplementedError("Exercise L1.4")


def assert_hidden_passes(exercise: str, fn) -> None:
    for seed in SEEDS:
        assert hidden_problems("L1_contiguous", exercise, fn, seed=seed) == [], (exercise, seed)


def assert_hidden_fails(exercise: str, fn) -> None:
    for seed in SEEDS:
        assert hidden_problems("L1_contiguous", exercise, fn, seed=seed), (exercise, seed)


# ---- L1.4 ring_positions ----


def ring_oldest(window, length):
    """Each row keeps the first position written there, as if the ring never overwrote."""
    if window < 1 or length < 0:
        raise ValueError(f"window {window}, length {length}")
    return [r if r < length else -1 for r in range(window)]


def ring_one_past(window, length):
    """Counts position ``length`` as written too."""
    if window < 1 or length < 0:
        raise ValueError(f"window {window}, length {length}")
    return answers.ring_positions(window, length + 1)


def ring_loop(window, length):
    """Right, by writing every position: fine for small lengths, never finishes for 10**15 (here it
    gives up at once instead of hanging the test)."""
    if window < 1 or length < 0:
        raise ValueError(f"window {window}, length {length}")
    if length > 10**6:
        raise TimeoutError("still looping")
    return checks.simulate_ring(window, length)


def ring_value_only(window, length):
    """Right rows; the ValueError gives the bad value but not the argument's name."""
    for value in (window, length):
        if value < (1 if value is window else 0):
            raise ValueError(f"got {value}")
    return answers.ring_positions(window, length)


def ring_last_row_a_lap_behind(window, length):
    """The last row one lap of the ring too early, once it has been written twice."""
    rows = answers.ring_positions(window, length)
    if rows[-1] >= window:
        rows[-1] -= window
    return rows


def ring_extra_row(window, length):
    """One row more than the window: row ``window`` as if it were part of the ring."""
    if window < 1 or length < 0:
        raise ValueError(f"window {window}, length {length}")
    return [*answers.ring_positions(window, length), -1]


@pytest.mark.parametrize("fn", [answers.ring_positions, "notebook"])
def test_ring_right_answers_pass(capsys, fn):
    fn = solution("ring_positions") if fn == "notebook" else fn
    checks.check_ring_positions(fn)
    assert_passes(graded_lines(capsys))
    assert_hidden_passes("L1.4", fn)


@pytest.mark.parametrize(
    ("wrong", "case_name", "rule"),
    [
        (ring_oldest, "window 4, 10 positions", "each row holds the oldest position written there"),
        (ring_one_past, "window 4, 3 positions", "off by one: length positions are 0 .. length - 1"),
        (ring_value_only, "window 0 is refused", "says 'got 0': name the argument window and its value 0"),
        (ring_last_row_a_lap_behind, "window 4, 10 positions", "rows [8, 9, 6, 3], expected [8, 9, 6, 7]"),
        (ring_extra_row, "window 1, 6 positions", "rows [5, -1], expected 1 row: [5]"),
        (stub, "window 4, 3 positions", "NotImplementedError"),
    ],
)
def test_ring_wrong_answers_fail_with_their_rule(capsys, wrong, case_name, rule):
    checks.check_ring_positions(wrong)
    lines = graded_lines(capsys)
    assert_fails(lines, case_name)
    assert any(case_name in line and rule in line for line in lines), lines
    assert_hidden_fails("L1.4", wrong)


def test_ring_a_loop_over_positions_fails_the_huge_cases(capsys):
    checks.check_ring_positions(ring_loop)
    lines = graded_lines(capsys)
    assert_fails(lines, "1,000,000,000,000,000 positions")
    assert lines[-1] == "7/9 passed", lines
    assert_hidden_fails("L1.4", ring_loop)


def test_ring_long_rows_show_the_first_row_that_differs(capsys):
    """Issue 37: the rows of the huge cases were cut at 80 characters, before the row that differed."""
    checks.check_ring_positions(ring_last_row_a_lap_behind)
    lines = graded_lines(capsys)
    (huge,) = [line for line in lines if "1,000,000,000,000,003 positions" in line]
    assert huge.endswith("WRONG — row 6 is 999999999999993, expected 1000000000000000"), huge  # 10**15 - 7
    checks.check_ring_positions(ring_one_past)
    (huge,) = [line for line in graded_lines(capsys) if "1,000,000,000,000,000 positions" in line]
    assert huge.endswith("WRONG — row 0 is 1000000000000000, expected 999999999999995"), huge
    assert checks.rows_problem([0, 5, 6, 7] + [10**15] * 6, [0, 1, 2, 3] + [10**15] * 6) == (
        "row 1 is 5, expected 1 (the first of 3 rows that differ)"
    )
    assert checks.rows_problem([10**15] * 7, [10**15] * 6) == "7 rows, expected 6 rows"


def test_ring_no_line_says_1_rows(capsys):
    for wrong in (ring_oldest, ring_one_past, ring_extra_row, ring_last_row_a_lap_behind, ring_value_only):
        checks.check_ring_positions(wrong)
        lines = graded_lines(capsys)
        assert not any(" 1 rows" in line for line in lines), lines


def test_a_value_error_must_name_the_argument_and_its_value():
    assert checks.names_value("window must be at least 1, got 0", "window", 0)
    assert checks.names_value("length=-3 is negative", "length", -3)
    assert not checks.names_value("got 0", "window", 0)  # no name
    assert not checks.names_value("window must be at least 10", "window", 0)  # 0 only inside 10
    assert not checks.names_value("length must be >= 0, got 3", "length", -3)  # the sign dropped


def test_ring_huge_rows_are_the_answers():
    """The visible checker's stored rows for the huge lengths are what the independent answer gives,
    and the simulation agrees with the answer wherever it can run."""
    for (window, length), rows in checks.RING_HUGE_ROWS.items():
        assert rows == answers.ring_positions(window, length)
    for window in range(1, 7):
        for length in range(0, 20):
            assert checks.simulate_ring(window, length) == answers.ring_positions(window, length)


def test_ring_time_limit_stops_a_loop():
    with pytest.raises(TimeoutError, match="still running after 1 s"):
        with checks.seconds_limit(1, "stop"):
            while True:
                pass


# ---- L1.5 contiguous_bytes ----


def bytes_last_token_cached(requests, max_model_len, bytes_per_token, block_size):
    """Counts P + N positions per request: the last new token's K/V as if it were written."""
    out = answers.contiguous_bytes(requests, max_model_len, bytes_per_token, block_size)
    fits = [(p, n) for p, n in requests if p >= 1 and n >= 1 and p + n <= max_model_len]
    out["used"] = sum(p + n for p, n in fits) * bytes_per_token
    return out


def bytes_exact_fit_refused(requests, max_model_len, bytes_per_token, block_size):
    """Refuses a request that ends exactly at max_model_len (>= instead of >)."""
    out = answers.contiguous_bytes(requests, max(max_model_len - 1, 1), bytes_per_token, block_size)
    if max_model_len < 1:
        raise ValueError(f"max_model_len {max_model_len}")
    kept = [r for i, r in enumerate(requests) if i not in out["refused"]]
    out["reserved"] = len(kept) * max_model_len * bytes_per_token
    return out


def bytes_no_size_check(requests, max_model_len, bytes_per_token, block_size):
    """Checks max_model_len and block_size but not bytes_per_token: the sums scale by whatever it is."""
    out = answers.contiguous_bytes(requests, max_model_len, 1, block_size)
    return {k: v if k == "refused" else v * bytes_per_token for k, v in out.items()}


def bytes_value_only(requests, max_model_len, bytes_per_token, block_size):
    """Right sums; the ValueError gives the bad value but not the argument's name."""
    for value in (max_model_len, bytes_per_token, block_size):
        if value < 1:
            raise ValueError(f"{value} is below 1")
    return answers.contiguous_bytes(requests, max_model_len, bytes_per_token, block_size)


@pytest.mark.parametrize("fn", [answers.contiguous_bytes, "notebook"])
def test_contiguous_right_answers_pass(capsys, fn):
    fn = solution("contiguous_bytes") if fn == "notebook" else fn
    checks.check_contiguous_bytes(fn)
    assert_passes(graded_lines(capsys))
    assert_hidden_passes("L1.5", fn)


@pytest.mark.parametrize(
    ("wrong", "case_name", "rule"),
    [
        (bytes_last_token_cached, "one short chat", "the last new token counted"),
        (
            bytes_exact_fit_refused,
            "one ends exactly at max_model_len",
            "ends exactly at max_model_len was refused",
        ),
        (bytes_no_size_check, "bytes_per_token -1 is refused", "no ValueError for bytes_per_token = -1"),
        (
            bytes_value_only,
            "max_model_len 0 is refused",
            "says '0 is below 1': name the argument max_model_len and its value 0",
        ),
        (stub, "one short chat", "NotImplementedError"),
    ],
)
def test_contiguous_wrong_answers_fail_with_their_rule(capsys, wrong, case_name, rule):
    checks.check_contiguous_bytes(wrong)
    lines = graded_lines(capsys)
    assert_fails(lines, case_name)
    assert any(case_name in line and rule in line for line in lines), lines
    assert_hidden_fails("L1.5", wrong)


def test_contiguous_simulation_matches_the_worked_example():
    """The notebook's example, and a hand-computed one: (10, 5) in a cache of 64 positions fills
    10 + 5 - 1 = 14 positions; at block_size 16 that is one block."""
    assert checks.simulate_contiguous([(9, 1)], 8, 10, 4) == {
        "reserved": 0,
        "used": 0,
        "paged": 0,
        "refused": [0],
    }
    assert checks.simulate_contiguous([(10, 5)], 64, 8, 16) == {
        "reserved": 64 * 8, "used": 14 * 8, "paged": 16 * 8, "refused": []
    }  # fmt: skip


# ---- both ----


@pytest.mark.parametrize("exercise", ["L1.4", "L1.5"])
def test_hidden_cases_differ_between_seeds(exercise):
    draw = checks.HIDDEN[exercise].draw
    drawn = [json.dumps(draw(hidden.rng_for(seed, exercise))) for seed in SEEDS]
    assert len(set(drawn)) == len(SEEDS)
    assert draw(random.Random("x")) == draw(random.Random("x"))


# ---- rules the warm-up checkers name (item 6) ----


def write_kv_swapped(k_cache, v_cache, start, k, v):
    end = start + k.shape[0]
    if end > k_cache.shape[0]:
        raise ValueError(f"positions {start}..{end - 1} overflow max_model_len={k_cache.shape[0]}")
    k_cache[start:end] = v
    v_cache[start:end] = k


def write_kv_late(k_cache, v_cache, start, k, v):
    end = start + k.shape[0]
    if end > k_cache.shape[0]:
        raise ValueError(f"positions {start}..{end - 1} overflow max_model_len={k_cache.shape[0]}")
    k_cache[start + 1 : end + 1] = k
    v_cache[start + 1 : end + 1] = v


@pytest.mark.parametrize(
    ("wrong", "rule"),
    [(write_kv_swapped, "K and V are swapped"), (write_kv_late, "one position late (start + 1)")],
)
def test_write_kv_names_the_rule(capsys, wrong, rule):
    checks.check_write_kv(wrong)
    lines = graded_lines(capsys)
    assert any("decode: 1 token at start 5" in line and rule in line for line in lines), lines


def test_kv_bytes_names_the_rule(capsys):
    from kvcourse.config import ModelConfig

    cfg = ModelConfig(
        model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
        tie_word_embeddings=True, max_position_embeddings=2048, eos_token_ids=(2,),
    )  # fmt: skip
    checks.check_kv_bytes_per_token(lambda c, b=4: c.num_layers * c.num_kv_heads * c.head_dim * b, cfg)
    lines = graded_lines(capsys)
    assert "(K only: the factor 2 for K and V is missing)" in lines[0], lines
    checks.check_kv_bytes_per_token(lambda c, b=4: 2 * c.num_layers * c.num_heads * c.head_dim * b, cfg)
    lines = graded_lines(capsys)
    assert "(query heads counted: K and V are stored per KV head)" in lines[0], lines
