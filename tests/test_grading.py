"""The notebook grader can fail and can pass: every reference notebook against its exercise notebook.

For each reference notebook ``key/notebooks/LN_*.ipynb`` (so later stages' notebooks are covered as soon
as they exist) and its exercise notebook ``notebooks/LN_*.ipynb``:

- the L6 reference notebook passes ``make grade``, every exercise but one given a wrong answer;
- the committed exercise notebook is exactly what ``make exercises`` produces now;
- an exercise notebook with a wrong answer, a right one and untouched ones is graded 1/N, each
  exercise with the right verdict (L6: covered by the reference run above, the slowest notebook
  graded once);
- the exercise notebook with the reference solutions put back is the reference notebook's code.

Grading runs the same command as the Makefile's ``grade`` target, as a subprocess; each run executes the
notebook once (without its cells tagged ``demo``). The tests at the bottom cover the marker handling on
a small hand-made notebook and the harness in ``kvcourse/grading/cases.py`` (a case's own prints are
dropped; a runaway loop is cut off).
"""

from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest
import submissions

from kvcourse.grading import exercises, isolated
from kvcourse.grading import gradebook as grade_module
from kvcourse.grading.cases import CallLimit, Case, run_cases, tensor_problem
from kvcourse.grading.exercises import LINK_RE, relinked
from kvcourse.grading.sandbox import BOX_HOME, SYSTEM, Sandbox, bwrap_works
from kvcourse.grading.workspace import make_workspace

ROOT = Path(__file__).resolve().parent.parent
REFERENCES = exercises.reference_notebooks(ROOT / "key" / "notebooks")

# A realistic wrong answer per notebook: (exercise number, code for that function body). Notebooks not
# listed get the generic one, an exercise 1 that returns None without doing anything.
WRONG_ANSWERS = {
    # the classic off-by-one: every write lands one position too far
    "L1_contiguous": (
        1,
        "k_cache[start + 1 : start + 1 + k.shape[0]] = k\nv_cache[start + 1 : start + 1 + v.shape[0]] = v\n",
    ),
}
GENERIC_WRONG = (1, "return None  # wrong on purpose: does nothing\n")
# L6's reference notebook, graded whole with one wrong answer: the pool copied to every device (the
# exercise that runs the engine over a mesh of 4 devices, which only a notebook kernel has).
L6_WRONG = (4, 'return {"params": P(), "decode_state": P(), "kv_pages": P()}\n')


def grade(*args: str) -> subprocess.CompletedProcess:
    """``make grade NB=...`` without make: ``python -m kvcourse.grading.gradebook`` with the Makefile's environment."""
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        MPLBACKEND="Agg",
        TOKENIZERS_PARALLELISM="false",
        # Spinning OpenMP threads make torch ~40x slower when another process holds a core (a decode
        # step took 1.9 s instead of 45 ms on the shared 2-core machine); make grade sets this too.
        OMP_WAIT_POLICY="PASSIVE",
    )
    cmd = [sys.executable, "-m", "kvcourse.grading.gradebook", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def last_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def report(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n{result.stdout[-6000:]}\n{result.stderr[-2000:]}"


def write(nb, path: Path) -> Path:
    path.write_text(exercises.render(nb), encoding="utf-8")
    return path


needs_notebooks = pytest.mark.skipif(not REFERENCES, reason="no key/notebooks/LN_*.ipynb yet")
per_notebook = pytest.mark.parametrize("reference", REFERENCES, ids=[p.stem for p in REFERENCES])


@needs_notebooks
@per_notebook
def test_committed_exercise_notebook_is_generated(reference):
    expected = exercises.render(
        exercises.make_exercise_notebook(exercises.read(reference), exercises.stage_of(reference))
    )
    committed = exercises.exercise_path(reference)
    assert committed.exists(), f"{committed} is missing: run `make exercises`"
    assert committed.read_text(encoding="utf-8") == expected, f"{committed} is stale: run `make exercises`"


@needs_notebooks
@per_notebook
def test_reference_has_exercises_and_checks(reference):
    nb = exercises.read(reference)
    assert exercises.solutions(nb), "a reference notebook needs at least one # BEGIN SOLUTION region"
    checks = [c for c in nb.cells if c.cell_type == "code" and exercises.CHECK_MARKER in c.source]
    assert checks, "a reference notebook needs check cells"
    for cell in checks:
        assert cell.execution_count is not None and cell.outputs, (
            "check cells must be executed: they hold the answers"
        )
        text = "".join(o.get("text", "") for o in cell.outputs)
        assert text.rstrip().endswith("passed") and "WRONG" not in text and "raised" not in text, text


@pytest.mark.slow
def test_the_l6_reference_notebook_passes_but_for_its_one_wrong_answer(tmp_path):
    """A whole reference notebook graded as a learner's, with one exercise answered wrong (L6, the
    slowest; the other notebooks' solutions pass inside the mixed runs below): that one WRONG, every
    other one PASS, (N-1)/N in the last line."""
    reference = ROOT / "key" / "notebooks" / "L6_tpu_jax.ipynb"
    solutions = exercises.solutions(exercises.read(reference))
    n, (number, wrong) = len(solutions), L6_WRONG
    exercise = exercises.read(exercises.exercise_path(reference))
    path = write(exercises.put_back(exercise, {**solutions, number: wrong}), tmp_path / reference.name)
    result = grade(str(path))
    lines = result.stdout.splitlines()
    assert result.returncode == 1, report(result)
    assert last_line(result) == f"graded {path}: {n - 1}/{n} exercises pass", report(result)
    assert any(x.startswith(f"L6.{number} ") and "WRONG" in x for x in lines), report(result)
    for k in set(range(1, n + 1)) - {number}:
        assert any(x.startswith(f"L6.{k} ") and x.endswith(": PASS") for x in lines), (k, report(result))


@pytest.mark.slow
@needs_notebooks
@pytest.mark.parametrize(
    "reference", [p for p in REFERENCES if p.stem != "L6_tpu_jax"], ids=lambda p: p.stem
)
def test_right_wrong_and_untouched_answers_are_told_apart(reference, tmp_path):
    """One grading run per notebook (L6: the test above): a realistic wrong answer to exercise 1, the
    reference solution to the last exercise, every other exercise left untouched. The report must
    say WRONG for the wrong one, PASS for the right one, "not done yet" for the rest, and 1/N in its
    last line."""
    solutions = exercises.solutions(exercises.read(reference))
    n = len(solutions)
    (number, wrong), right = WRONG_ANSWERS.get(reference.stem, GENERIC_WRONG), n
    exercise = exercises.read(exercises.exercise_path(reference))
    path = write(
        exercises.put_back(exercise, {number: wrong, right: solutions[right]}), tmp_path / reference.name
    )
    result = grade(str(path))
    stage = exercises.stage_of(reference)
    lines = result.stdout.splitlines()
    assert result.returncode == 1, report(result)
    assert last_line(result) == f"graded {path}: 1/{n} exercises pass", report(result)
    assert any(x.startswith(f"{stage}.{right} ") and x.endswith(": PASS") for x in lines), report(result)
    assert any(x.startswith(f"{stage}.{number} ") and "WRONG" in x for x in lines), report(result)
    if n > 2:
        assert "not done yet (it raises NotImplementedError)" in result.stdout, report(result)


@needs_notebooks
@per_notebook
def test_solutions_put_back_give_the_reference_code(reference):
    """The exercise notebook with the reference solutions put back is the reference notebook's code,
    code cell for code cell (markdown differs only in its relative links), so the reference notebook passing grading (above) covers it."""
    ref = exercises.read(reference)
    restored = exercises.put_back(
        exercises.read(exercises.exercise_path(reference)), exercises.solutions(ref)
    )

    def code(source: str) -> str:  # the reference's code without its solution markers
        lines = source.split("\n")
        return "\n".join(x for x in lines if not (exercises.BEGIN_RE.match(x) or exercises.END_RE.match(x)))

    assert [c.source for c in restored.cells if c.cell_type == "code"] == [
        code(c.source) for c in ref.cells if c.cell_type == "code"
    ]


@pytest.mark.slow
def test_a_class_gets_an_honest_row_each(tmp_path):
    """``make grade DIR=...`` on a class (tests/submissions.py): untouched, correct (with debugging
    prints, which must not cost the grade), crashing, hanging, check-edited and three cheats. Each row
    has the right marks and the right note; a cheat gets 0 whatever its check cells printed. With
    bubblewrap, a ninth notebook tries to write into the repository and to reach a socket the test
    listens on: neither works, and its grade is unaffected."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0)
    port = listener.getsockname()[1]
    escape = ROOT / "ESCAPED_BY_A_SUBMISSION"
    boxed = bwrap_works() is None
    submissions.write_class(tmp_path, escape=(escape, port) if boxed else None)
    unsafe = [] if boxed else ["--no-sandbox"]  # refused otherwise, and every row says so
    result = grade("--dir", str(tmp_path), "--timeout", "30", "--seed", "7", *unsafe)
    assert result.returncode == 0, report(result)
    rows = {
        row["notebook"].removesuffix(".ipynb"): row
        for row in csv.DictReader((tmp_path / "gradebook.csv").open())
    }
    for row in rows.values():
        if not boxed:
            assert grade_module.UNSAFE_NOTE in row["note"], row
        row["note"] = "; ".join(n for n in row["note"].split("; ") if n not in ("", grade_module.UNSAFE_NOTE))
    expected = dict(submissions.EXPECTED, **({"escaping": submissions.ESCAPING} if boxed else {}))
    assert rows.keys() == expected.keys(), report(result)
    for name, (marks, note) in expected.items():
        row = rows[name]
        assert [row[f"L2.{k}"] for k in range(1, submissions.N + 1)] == marks, (name, row, report(result))
        assert row["passed"] == str(marks.count("pass")) and row["seed"] == "7", (name, row)
        assert (note in row["note"]) if note else row["note"] == "", (name, row["note"])
    if boxed:
        assert not escape.exists(), "a submission wrote into the repository"
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected from inside the sandbox
    listener.close()


@pytest.mark.slow
def test_each_attack_gets_nothing_and_a_note_naming_it(tmp_path):
    """The attacks of issue 45 (tests/submissions.py ``write_attacks``): another stage's identical copy
    as the oracle, forged records, a catch-the-bug test that compares bytecode, reading the key, the
    grader patched through an alias. Each cheat passes the cases its notebook shows; each gets 0, and
    its note (or its failing line) names what it did. With bubblewrap the other checkout's key is out
    of sight; without it the class is graded with --no-sandbox."""
    boxed = bwrap_works() is None
    (tmp_path / "class").mkdir()
    submissions.write_attacks(tmp_path / "class", tmp_path / "other-checkout" / "key" / "answers.py")
    unsafe = [] if boxed else ["--no-sandbox"]
    result = grade("--dir", str(tmp_path / "class"), "--timeout", "30", "--seed", "7", *unsafe)
    assert result.returncode == 0, report(result)
    rows = {
        row["notebook"].removesuffix(".ipynb"): row
        for row in csv.DictReader((tmp_path / "class" / "gradebook.csv").open())
    }
    assert rows.keys() == submissions.ATTACKS.keys(), report(result)
    reports, lines = {}, []
    for line in result.stdout.splitlines():  # each notebook's report ends with its "graded <path>" line
        lines.append(line)
        if line.startswith("graded "):
            reports[Path(line.split()[1].rstrip(":")).stem], lines = "\n".join(lines), []
    for name, (marks, note) in submissions.ATTACKS.items():
        row = rows[name]
        assert [row[f"L2.{k}"] for k in range(1, submissions.N + 1)] == marks, (name, row, report(result))
        block = reports[name]
        assert note in row["note"] or note in block, (name, row["note"], block)
        assert submissions.ATTACK_SAYS.get(name, "") in block + row["note"], (name, block)
    assert not Path("/tmp/forged.json").exists()


def test_the_nbval_run_loads_its_plugins_without_rfc3987_syntax():
    """The grader's nbval run loads the report's package before nbval (gradebook.nbval_command), and
    that keeps jsonschema from importing rfc3987_syntax (a Lark grammar built at each start): after the
    run's plugins load in the command's order, the module is absent and nbformat still validates."""
    argv = grade_module.nbval_command(Path("nb.ipynb"), Path("sanitize.cfg"), 60)
    plugins = [argv[i + 1] for i, a in enumerate(argv) if a == "-p" and not argv[i + 1].startswith("no:")]
    assert plugins.index("kvcourse.grading.nbval_report") < plugins.index("nbval.plugin"), argv
    code = (
        f"import sys, {', '.join(plugins)}, nbformat\n"
        "assert sys.modules['rfc3987_syntax'] is None, sys.modules.get('rfc3987_syntax')\n"
        f"nbformat.validate(nbformat.read({str(exercises.NOTEBOOKS / 'L2_token_flat.ipynb')!r}, as_version=4))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_typo_in_ex_is_one_line():
    """``make grade EX=L1.9``: one ``error:`` line naming the exercises, exit 2, no traceback."""
    result = grade("--exercise", "L1.9", str(ROOT / "key" / "notebooks" / "L1_contiguous.ipynb"))
    assert result.returncode == 2, report(result)
    assert result.stderr.count("\n") <= 2 and "error: no exercise 'L1.9'" in result.stderr, result.stderr
    assert "L1.1" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(bwrap_works() is not None, reason=f"optional dependency missing: {bwrap_works()}")
def test_the_sandbox_holds_a_process_in(tmp_path):
    """What ``make grade`` runs a submission in: the repository read-only, the answer key covered, no
    network (not even the host's loopback), a private /tmp, one writable work folder, and nothing else
    of the machine but the read-only runtime: no home folder, no sibling of the folders it needs (the
    full course a venv or cache lives in), no process of the grader in its /proc."""
    listener = socket.create_server(("127.0.0.1", 0))
    outside = Path(tempfile.mkdtemp(prefix="kvcourse-outside-"))  # the host's /tmp, which the box hides
    probe = f"""
import os, socket, pathlib
def attempt(f):
    try:
        f()
        return "ok"
    except OSError as e:
        return type(e).__name__
print("repo", attempt(lambda: pathlib.Path({str(ROOT / "SANDBOX_PROBE")!r}).write_text("x")))
print("net", attempt(lambda: socket.create_connection(("127.0.0.1", {listener.getsockname()[1]}), timeout=2)))
print("outside", attempt(lambda: socket.create_connection(("1.1.1.1", 53), timeout=2)))
print("work", attempt(lambda: pathlib.Path({str(tmp_path / "out.txt")!r}).write_text("x")))
print("tmp", os.path.exists({str(outside)!r}))
def read(path):
    try:
        return repr(pathlib.Path(path).read_text())
    except OSError as e:
        return type(e).__name__
print("key", os.listdir({str(ROOT / "key")!r}), os.path.exists({str(ROOT / "key" / "L2_token_flat" / "answers.py")!r}))
print("root", sorted(os.listdir("/")))
print("procs", len([d for d in os.listdir("/proc") if d.isdigit()]))
print("home", os.path.exists({str(Path.home())!r}))
print("siblings", sorted({{str(p.parent) + "/" + n for p in map(pathlib.Path, {[str(p) for p in Sandbox.here(ROOT, 1, 1).needed()]!r}) for n in os.listdir(p.parent)}}))
"""
    box = Sandbox.here(ROOT, memory_bytes=4 << 30, cpu_seconds=60)
    argv, limits = box.wrap([sys.executable, "-c", probe], tmp_path)
    done = subprocess.run(argv, capture_output=True, text=True, preexec_fn=limits, timeout=60)
    listener.close()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "repo OSError" and lines[3] == "work ok", lines
    assert lines[1] != "net ok" and lines[2] != "outside ok", lines
    assert lines[4] == "tmp False", lines
    assert lines[5] == "key [] False", lines  # covered: key/ is an empty folder in the box
    needed = box.needed()
    runtime = {Path(p).name for p in SYSTEM} | {"dev", "proc", "tmp"} | {p.parts[1] for p in needed}
    assert set(eval(lines[6].removeprefix("root "))) <= runtime, lines[6]
    assert int(lines[7].removeprefix("procs ")) <= 2, lines[7]  # bwrap's init and the probe
    if not any(p.is_relative_to(Path.home()) for p in needed):
        assert lines[8] == "home False", lines[8]
    visible = {Path(p) for p in eval(lines[9].removeprefix("siblings "))}
    allowed = [*needed, tmp_path, Path(BOX_HOME)]  # the box's own home sits in its private /tmp
    assert all(any(v == p or p.is_relative_to(v) or v.is_relative_to(p) for p in allowed) for v in visible), (
        visible,
        needed,
    )
    assert not (ROOT / "SANDBOX_PROBE").exists()


def test_a_repository_under_tmp_stays_visible_in_the_box():
    """The box empties /tmp; a clone there (CI's, a learner's scratch copy) is brought back read-only,
    after which the answer key is covered again."""
    clone = Path(tempfile.mkdtemp(prefix="kvcourse-clone-"))
    (clone / "key").mkdir()
    box = Sandbox(clone, memory_bytes=1 << 30, cpu_seconds=10, use_bwrap=True)
    assert clone in box.needed()
    args = box.wrap(["true"], clone / "work")[0]
    assert args.index(str(clone)) < args.index(str(clone / "key")) < args.index(str(clone / "work"))


def test_without_bubblewrap_the_grader_says_so_and_how_to_install_it(monkeypatch):
    box = Sandbox(ROOT, memory_bytes=1 << 30, cpu_seconds=10, use_bwrap=False)
    monkeypatch.setattr("kvcourse.grading.sandbox.bwrap_works", lambda: "bubblewrap (bwrap) is not installed")
    assert box.warning().startswith("warning: bubblewrap (bwrap) is not installed: notebooks run with")
    assert "apt-get install bubblewrap" in box.warning()
    argv, _ = box.wrap(["python", "-c", "pass"], ROOT)
    assert argv == ["python", "-c", "pass"]


def test_without_bubblewrap_a_class_is_refused_unless_asked_for(monkeypatch, tmp_path, capsys):
    """Without a sandbox a submission could read the key: ``DIR=`` (and ``KEY=``) are refused, naming
    the flag; with ``--no-sandbox`` the class is graded and every row's note says how."""
    monkeypatch.setattr(grade_module, "bwrap_works", lambda: "bubblewrap (bwrap) is not installed")
    monkeypatch.setattr(
        grade_module.Sandbox, "here", classmethod(lambda cls, repo, m, c, key=None: cls(repo, m, c, False, key))
    )
    assert grade_module.main(["--dir", str(tmp_path)]) == 2
    said = capsys.readouterr().err
    assert "refusing to grade untrusted notebooks without a sandbox" in said and "--no-sandbox" in said
    (tmp_path / "empty.ipynb").write_text("not a notebook")
    assert grade_module.main(["--dir", str(tmp_path), "--no-sandbox"]) == 0
    rows = list(csv.DictReader((tmp_path / "gradebook.csv").open()))
    assert len(rows) == 1 and grade_module.UNSAFE_NOTE in rows[0]["note"], rows


def test_workspace_copies_once_with_links_that_resolve(tmp_path):
    copied, kept = make_workspace(tmp_path)
    assert copied and not kept
    for path in tmp_path.glob("*.ipynb"):
        for cell in exercises.read(path).cells:
            if cell.cell_type == "markdown":
                for target in LINK_RE.findall(cell.source):
                    assert (tmp_path / target).resolve().is_relative_to(ROOT), (path.name, target)
                    if tmp_path.parent == ROOT:  # links resolve where make workspace puts them
                        assert (tmp_path / target).exists(), (path.name, target)
    (tmp_path / copied[0]).write_text("my work", encoding="utf-8")
    assert make_workspace(tmp_path) == ([], copied)
    assert (tmp_path / copied[0]).read_text(encoding="utf-8") == "my work"


def test_workspace_links_resolve_in_workspace():
    """The relative links of every exercise notebook, moved to workspace/, name files that exist."""
    for source in sorted((ROOT / "notebooks").glob("L[0-9]*_*.ipynb")):
        nb = relinked(exercises.read(source), source.parent, ROOT / "workspace")
        targets = [t for c in nb.cells if c.cell_type == "markdown" for t in LINK_RE.findall(c.source)]
        assert targets, source.name
        for target in targets:
            assert (ROOT / "workspace" / target).resolve().exists(), (source.name, target)


# --- the pieces, on a hand-made notebook ---------------------------------------------------------------


def small_reference():
    v4 = nbformat.v4
    nb = v4.new_notebook(
        cells=[
            v4.new_markdown_cell("See [the chapter](../../lessons/L9_x.md) and [docs](https://example.org)."),
            v4.new_code_cell(
                "def f(x):\n    # BEGIN SOLUTION: double it\n    y = 2 * x\n    return y\n    # END SOLUTION\n\n"
                "def g():\n    # BEGIN SOLUTION\n    return 0\n    # END SOLUTION",
                execution_count=1,
                outputs=[v4.new_output("stream", text="hi\n")],
            ),
            v4.new_code_cell(
                "# NBVAL_CHECK_OUTPUT\nprint(f(2))",
                execution_count=2,
                outputs=[v4.new_output("stream", text="4\n")],
            ),
        ]
    )
    for i, cell in enumerate(nb.cells):
        cell.id = f"c{i}"
        cell.metadata["execution"] = {"iopub.status.idle": "2026-01-01T00:00:00Z"}
    return nb


def test_stubs_replace_regions_and_check_cells_keep_answers():
    ref = small_reference()
    ex = exercises.make_exercise_notebook(ref, "L9")
    assert ex.cells[1].source == (
        'def f(x):\n    raise NotImplementedError("Exercise L9.1: double it")\n\n'
        'def g():\n    raise NotImplementedError("Exercise L9.2")'
    )
    assert ex.cells[1].outputs == [] and ex.cells[1].execution_count is None
    assert ex.cells[2].outputs == ref.cells[2].outputs and ex.cells[2].execution_count == 2
    assert all("execution" not in c.metadata for c in ex.cells)
    assert "(../lessons/L9_x.md)" in ex.cells[0].source and "(https://example.org)" in ex.cells[0].source
    assert ref.cells[1].outputs, "the reference notebook itself is left alone"
    assert exercises.render(ex) == exercises.render(exercises.make_exercise_notebook(ref, "L9"))


def test_put_back_restores_the_solution_code():
    ref = small_reference()
    ex = exercises.make_exercise_notebook(ref, "L9")
    assert exercises.solutions(ref) == {1: "y = 2 * x\nreturn y\n", 2: "return 0\n"}
    restored = exercises.put_back(ex, exercises.solutions(ref))
    assert restored.cells[1].source == "def f(x):\n    y = 2 * x\n    return y\n\ndef g():\n    return 0"
    partial = exercises.put_back(ex, {2: "return 1\n"})
    assert 'NotImplementedError("Exercise L9.1: double it")' in partial.cells[1].source
    assert "    return 1" in partial.cells[1].source


@pytest.mark.parametrize(
    "source, message",
    [
        ("# BEGIN SOLUTION\nx = 1", "without '# END SOLUTION'"),
        ("x = 1\n# END SOLUTION", "without '# BEGIN SOLUTION'"),
        ("# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION", "inside another"),
        ("# BEGIN SOLUTION\n\n# END SOLUTION", "empty solution region"),
        ("# NBVAL_CHECK_OUTPUT\n# BEGIN SOLUTION\nx = 1\n# END SOLUTION", "check cell"),
    ],
)
def test_bad_markers_are_refused(source, message):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    with pytest.raises(ValueError, match=message):
        exercises.make_exercise_notebook(nb, "L9")


def test_run_cases_reports_each_case(capsys):
    def boom():
        raise NotImplementedError("Exercise L9.1: double it")

    passed = run_cases(
        [Case("fine", lambda: None), Case("off", lambda: "expected 4, got 5"), Case("stub", boom)]
    )
    assert passed == (1, 3)
    assert capsys.readouterr().out.splitlines() == [
        "case 1 (fine): ok",
        "case 2 (off): WRONG — expected 4, got 5",
        "case 3 (stub): raised NotImplementedError: Exercise L9.1: double it",
        "1/3 passed",
    ]


def test_run_cases_drops_what_a_case_prints(capsys):
    def chatty():  # a correct answer with a stray debugging print
        print("debug: k_cache shape (16, 3, 4)")
        return None

    def chatty_and_wrong():
        print("debug: start", 5)
        return "expected 4, got 5"

    def chatty_and_raises():
        print("about to fail")
        raise ValueError("bad start")

    passed = run_cases(
        [
            Case("prints, ok", chatty),
            Case("prints, off", chatty_and_wrong),
            Case("prints, raises", chatty_and_raises),
        ]
    )
    assert passed == (1, 3)
    assert capsys.readouterr().out.splitlines() == [
        "case 1 (prints, ok): ok",
        "case 2 (prints, off): WRONG — expected 4, got 5",
        "case 3 (prints, raises): raised ValueError: bad start",
        "1/3 passed",
    ]
    print("after")  # stdout is restored once the cases have run
    assert capsys.readouterr().out == "after\n"


def test_call_limit_stops_a_loop_that_runs_past_its_limit():
    class Engine:
        name = "tiny"

        def decode_step(self, token, pos):
            return token + pos

    limited = CallLimit(Engine(), "decode_step", 2, "does the loop stop at max_new_tokens?")
    assert limited.name == "tiny"
    assert [limited.decode_step(1, p) for p in range(2)] == [1, 2]
    with pytest.raises(RuntimeError, match="decode_step called more than 2 times: does the loop stop"):
        limited.decode_step(1, 2)


def test_tensor_problem_names_the_rows():
    import torch

    expected = torch.zeros(4, 2)
    got = expected.clone()
    assert tensor_problem("K", expected, got) is None
    got[2, 1] = 0.5
    assert tensor_problem("K", expected, got) == "K differs at positions [2] (max abs diff 0.5)"
    assert tensor_problem("K", expected, got[:3]) == "K has shape (3, 2), expected (4, 2)"


def test_the_run_takes_the_learners_exercise_cells_and_the_keys_others(tmp_path):
    """What make grade runs (no kernel here): the learner's exercise cells and added cells where the
    learner put them; the key's setup and check cells whatever the learner did to them; no cell of the
    grader's (the hidden cases run in a process of their own); demo cells left out. The isolated run
    takes the definitions of the learner's cells only."""
    key = exercises.read(ROOT / "notebooks" / "L2_token_flat.ipynb")
    nb = exercises.put_back(key, {1: "return []\n"})
    code = [c for c in nb.cells if c.cell_type == "code"]
    code[0].source = "print('my own setup')"  # an edited setup cell: the key's runs instead
    checks = [c for c in code if exercises.CHECK_MARKER in c.source]
    checks[0].source = "# NBVAL_CHECK_OUTPUT\nprint('5/5 passed')"  # an edited check cell: the key's runs
    stub2 = next(c for c in code if '"Exercise L2.2' in c.source)
    helper = nbformat.v4.new_code_cell("def helper():\n    return 1")
    answer2 = nbformat.v4.new_code_cell("def free(self, blocks):\n    pass")
    nb.cells.insert(nb.cells.index(stub2), helper)
    nb.cells[nb.cells.index(stub2)] = answer2  # L2.2's stub cell deleted, its answer in a new cell
    exs = grade_module.exercises_of(key)
    cells = grade_module.build_run(nb, key, exs, None)
    roles = [(c.role, c.exercise_id) for c in cells]
    sources = [c.source for c in cells]
    key_code = [c for c in key.cells if c.cell_type == "code" and "demo" not in c.metadata.get("tags", [])]
    assert sources[0] == key_code[0].source and "my own setup" not in "".join(sources)
    assert "print('5/5 passed')" not in "".join(sources)
    assert sources.count(helper.source) == 1 and sources.count(answer2.source) == 1
    assert sources.index(helper.source) < sources.index(answer2.source)
    assert not any('"Exercise L2.2' in s for s in sources)  # the deleted stub does not come back
    assert {r[0] for r in roles} == {"course", "learner", "check"}
    assert [r for r in roles if r[0] == "check"] == [("check", f"L2.{k}") for k in range(1, len(exs) + 1)]
    assert roles[sources.index(answer2.source)] == ("learner", "L2.2")
    first_check = next(c for c in key.cells if exercises.CHECK_MARKER in c.source)
    assert grade_module.check_args(first_check.source) == "alloc_blocks"
    cell = "import os\nos.remove('x')\nchecks.check_free = print\nLIMIT = 3\ndef f():\n    return LIMIT"
    assert isolated.definitions(cell) == "import os\nLIMIT = 3\n\ndef f():\n    return LIMIT"
