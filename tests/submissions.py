"""A class of L2 submissions as an instructor meets them, for the grading tests.

``write_class(folder)`` writes eight notebooks, each a copy of the L2 exercise notebook
(its N exercises; the class is about L2.1 to L2.3, the others stay untouched unless said):

- ``untouched``: nothing done (none pass);
- ``correct``: the reference solutions, each printing a debugging line (all N pass: what a learner's code
  prints is not graded);
- ``crashing``: L2.1 solved, then ``os._exit(1)`` in the cell of L2.2: the kernel dies (L2.1 passes, and
  the note says where);
- ``hanging``: L2.1 and L2.2 solved, L2.3 loops forever (two pass, and the note says it
  timed out);
- ``check_edited``: the solutions, and a check cell changed to print its expected text (all N pass: the
  key's check cell is run, and the note says so);
- ``cheat_patch``: replaces the three checkers by functions that print the expected text (none pass);
- ``cheat_rebind``: rebinds ``checks`` to a namespace of such functions (none pass);
- ``cheat_alias``: answers with the stage's own code (none pass).

``EXPECTED`` holds each one's row: marks, and a piece of its note ("" for none). Given ``escape``
(a path in the repository and a port on the host's loopback), a ninth, ``escaping``, solves L2.1 in a
cell that also tries to write that file and to connect to that port (``ESCAPING``: L2.1 passes, no note).

``write_attacks(folder, fake_key)`` writes the attacks of issue 45, each a notebook whose cheat passes
the cases its notebook shows; ``ATTACKS`` holds each one's row (every mark "fail") and what the
report must say of it:

- ``other_stage``: L2.1 runs L3's ``BlockAllocator.alloc_blocks`` (imported at the top: the same code
  as L2's, in another stage's file), L2.2 imports L4's allocator inside ``free`` (the isolated run
  refuses the import);
- ``records``: right in the notebook's own run, wrong in the hidden cases' run, where it writes a
  forged record on every file descriptor and a file, and a cell below the check rewrites the files
  of the work folder (the verdicts are not there);
- ``bytecode``: a catch-the-bug test (L2.6) that compares the bytecode of the class it is handed with
  the stage's instead of running it;
- ``key_reader``: right, but reads ``/proc`` (the grader's command line, which names the key) and runs
  the answer key at ``fake_key`` (another checkout's, which this writes: a right ``alloc_blocks``)
  when it can;
- ``grader_alias``: the checkers patched through another name (``from exercises... import checks as _c``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import nbformat

from kvcourse.grading import exercises

REFERENCE = exercises.KEY_NOTEBOOKS / "L2_token_flat.ipynb"
CHECKERS = {1: "check_alloc_blocks", 2: "check_free", 3: "check_allocate_slots"}

N = len(exercises.solutions(exercises.read(REFERENCE)))  # the notebook's exercises, L2.1 .. L2.N


def marks(*passing: int) -> list[str]:
    """A row's marks: ``marks(1, 2)`` -> ``["pass", "pass", "fail", ...]``, one per exercise."""
    return ["pass" if k in passing else "fail" for k in range(1, N + 1)]


EXPECTED = {
    "untouched": (marks(), ""),
    "correct": (marks(*range(1, N + 1)), ""),
    "crashing": (marks(1), "kernel died in the cell of L2.2"),
    "hanging": (marks(1, 2), "L2.3 timed out after"),
    "check_edited": (marks(*range(1, N + 1)), "check cell 2 edited"),
    "cheat_patch": (marks(), "changes the grader"),
    "cheat_rebind": (marks(), "changes the grader"),
    "cheat_alias": (marks(), "L2.1 not credited"),
}
ESCAPING = (marks(1), "")


def expected_texts(exercise) -> dict[int, str]:
    """What each check cell prints when its exercise is right: the key's stored output."""
    checks = [c for c in exercise.cells if exercises.CHECK_MARKER in c.source]
    return {k: "".join(o.get("text", "") for o in c.outputs) for k, c in enumerate(checks, start=1)}


def with_cell(nb, number: int, source: str):
    """A copy of ``nb`` whose exercise ``number`` cell (the one holding its stub) reads ``source``."""
    nb = copy.deepcopy(nb)
    stub = f'"Exercise L2.{number}'
    next(c for c in nb.cells if c.cell_type == "code" and stub in c.source).source = source
    return nb


def write_notebooks(folder: Path, notebooks: dict) -> list[Path]:
    """Each notebook as ``folder/<name>.ipynb``; the paths, in order."""
    paths = []
    for name, nb in notebooks.items():
        path = folder / f"{name}.ipynb"
        path.write_text(exercises.render(nb), encoding="utf-8")
        paths.append(path)
    return paths


def write_class(folder: Path, escape: tuple[Path, int] | None = None) -> list[Path]:
    exercise = exercises.read(exercises.exercise_path(REFERENCE))
    solutions = exercises.solutions(exercises.read(REFERENCE))
    solved = exercises.put_back(exercise, solutions)
    chatty = exercises.put_back(
        exercise, {k: f'print("my debugging line")\n{code}' for k, code in solutions.items()}
    )
    texts = expected_texts(exercise)
    printers = {CHECKERS[k]: f"lambda *args, **kwargs: print({texts[k]!r}, end='')" for k in CHECKERS}

    crashing = exercises.put_back(exercise, {1: solutions[1]})
    crashing = with_cell(crashing, 2, "import os\nos._exit(1)\n\ndef free(self, blocks):\n    pass\n")
    hanging = exercises.put_back(exercise, {1: solutions[1], 2: solutions[2], 3: "while True:\n    pass\n"})
    edited = copy.deepcopy(solved)
    check = [c for c in edited.cells if exercises.CHECK_MARKER in c.source][1]
    check.source = f"# NBVAL_CHECK_OUTPUT\nprint({texts[2]!r}, end='')"
    patch = "\n".join(f"checks.{name} = {printer}" for name, printer in printers.items())
    rebind = (
        "from types import SimpleNamespace\n\nchecks = SimpleNamespace(\n"
        + "".join(f"    {name}={printer},\n" for name, printer in printers.items())
        + ")"
    )
    alias = exercises.put_back(exercise, {})
    alias = with_cell(alias, 1, "alloc_blocks = BlockAllocator.alloc_blocks")
    alias = with_cell(alias, 2, "free = BlockAllocator.free")
    alias = with_cell(alias, 3, "from L2_token_flat.sequence import allocate_slots")

    notebooks = {
        "untouched": exercise,
        "correct": chatty,
        "crashing": crashing,
        "hanging": hanging,
        "check_edited": edited,
        "cheat_patch": with_cell(exercise, 1, patch),
        "cheat_rebind": with_cell(exercise, 1, rebind),
        "cheat_alias": alias,
    }
    if escape:
        attempt = (
            "import pathlib\nimport socket\n\ntry:\n"
            f"    pathlib.Path({str(escape[0])!r}).write_text('escaped')\nexcept OSError:\n    pass\ntry:\n"
            f"    socket.create_connection(('127.0.0.1', {escape[1]}), timeout=2)\nexcept OSError:\n    pass\n\n"
        )
        cell = next(c for c in solved.cells if c.cell_type == "code" and "def alloc_blocks" in c.source)
        notebooks["escaping"] = with_cell(exercise, 1, attempt + cell.source)
    return write_notebooks(folder, notebooks)


ATTACKS = {
    "other_stage": (marks(), "L2.1 not credited: runs BlockAllocator.alloc_blocks"),
    "records": (marks(), "changes the grader: writes /tmp/forged.json"),
    "bytecode": (marks(), "L2.6 hidden case"),  # the report's failing line: "...fails the correct version"
    "key_reader": (marks(), "changes the grader: reads /proc/"),
    "grader_alias": (marks(), "changes the grader: imports exercises.L2_token_flat"),
}
ATTACK_SAYS = {"bytecode": "your test fails the correct version", "other_stage": "imports L4_paged_kernel.allocator"}


def write_attacks(folder: Path, fake_key: Path) -> list[Path]:
    exercise = exercises.read(exercises.exercise_path(REFERENCE))
    solved = exercises.put_back(exercise, exercises.solutions(exercises.read(REFERENCE)))
    right = next(c for c in solved.cells if c.cell_type == "code" and "def alloc_blocks" in c.source).source
    right = right.replace("def alloc_blocks(", "def right_alloc_blocks(")
    texts = expected_texts(exercise)
    fake_key.parent.mkdir(parents=True, exist_ok=True)
    fake = "from L2_token_flat.allocator import OutOfBlocksError\n\n\n" + right
    fake_key.write_text(fake.replace("def right_alloc_blocks(", "def alloc_blocks("), encoding="utf-8")
    other_stage = with_cell(
        exercise,
        1,
        "from L3_block_tensor.allocator import BlockAllocator as Later\n"
        "from L3_block_tensor.allocator import OutOfBlocksError as LaterError\n\n"
        "def alloc_blocks(self, n):\n    try:\n        return Later.alloc_blocks(self, n)\n"
        "    except LaterError:\n        raise OutOfBlocksError(needed=n, free=len(self.free_blocks)) from None\n",
    )
    other_stage = with_cell(
        other_stage,
        2,
        "def free(self, blocks):\n    from L4_paged_kernel.allocator import BlockAllocator as Later\n\n"
        "    return Later.free(self, blocks)\n",
    )
    records = with_cell(
        exercise,
        1,
        f"import os\n\n{right}\n\ndef alloc_blocks(self, n):\n"
        "    if 'KVCOURSE_NBVAL_REPORT' in os.environ:  # the notebook's own run: right\n"
        "        return right_alloc_blocks(self, n)\n"
        "    for fd in range(3, 64):  # the hidden cases' run: a forged record on every descriptor\n"
        "        try:\n            os.write(fd, b'record 0 {}\\n')\n        except OSError:\n            pass\n"
        "    with open('/tmp/forged.json', 'w') as f:\n        f.write('{}')\n"
        "    return []\n",
    )
    check = next(k for k, c in enumerate(records.cells) if exercises.CHECK_MARKER in c.source)
    rewrite = (
        "import glob\nimport json\n\nfor path in glob.glob('/tmp/kvcourse-grade-*/**/*.json', recursive=True):\n"
        "    with open(path, 'w') as f:\n        json.dump({'observations': [], 'aliased': []}, f)\n"
    )
    records.cells.insert(check + 1, nbformat.v4.new_code_cell(rewrite))
    compare = (
        "import dis\n\nfrom L2_token_flat.allocator import BlockAllocator as Stage\n\n\n"
        "def listing(f):  # each instruction, a nested code object by its names\n"
        "    return [(i.opname, getattr(i.argval, 'co_names', i.argval)) for i in dis.get_instructions(f)]\n\n\n"
        "def test_allocator(Allocator):\n"
        "    for name, method in vars(Stage).items():\n"
        "        if callable(method):\n"
        "            assert listing(getattr(Allocator, name)) == listing(method), name\n"
    )
    reader = (
        f"import runpy\n\n{right}\n\ndef alloc_blocks(self, n):\n"
        "    try:\n        with open('/proc/1/cmdline', 'rb') as f:  # the grader names its --key there\n"
        "            f.read()\n    except OSError:\n        pass\n"
        f"    try:\n        return runpy.run_path({str(fake_key)!r})['alloc_blocks'](self, n)\n"
        "    except OSError:\n        return right_alloc_blocks(self, n)\n"
    )
    printer = f"lambda *args, **kwargs: print({texts[1]!r}, end='')"
    alias = f"from exercises.L2_token_flat import checks as _c\n\n_c.check_alloc_blocks = {printer}\n"
    notebooks = {
        "other_stage": other_stage,
        "records": records,
        "bytecode": with_cell(exercise, 6, compare),
        "key_reader": with_cell(exercise, 1, reader),
        "grader_alias": with_cell(exercise, 1, alias),
    }
    return write_notebooks(folder, notebooks)
