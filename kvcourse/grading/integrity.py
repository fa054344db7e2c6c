"""What a submission's own code reaches for, read from its source before it runs.

The grader decides in its own process (``kvcourse/grading/hidden.py``), so a notebook that patches a checker
or prints the expected text changes no verdict. Such a notebook still deserves a note, and an answer
that hands the exercise to the stage's own code deserves no credit. ``scan`` reads the learner's
cells (exercise cells and cells the learner added; the other cells are the course's and are run as
the exercise notebook has them) and returns findings of two kinds:

- **tampering**, anywhere in the learner's code: changing or using the grader through any name that
  holds it (``checks``, a name an import of ``exercises`` or ``kvcourse.grading`` binds, a name
  assigned from one: ``grader_names``): rebinding it or one of its names, reading one that is not a
  ``check_`` function, passing it around, importing or reaching ``exercises`` or ``kvcourse.grading``, the import machinery (``sys.modules``, ``importlib``,
  ``__import__``, ``builtins``), tracing hooks, code objects, ``exec``/``eval``/``compile``, or the
  answer key (the ``key`` package, an ``answers`` module, a ``.ipynb`` file). The whole notebook is
  not credited;
- **aliasing**, per exercise: importing the stage's own implementation of what the exercise asks
  (``from L2_token_flat.sequence import allocate_slots``) or reading it off its class
  (``BlockAllocator.alloc_blocks``, ``super().alloc_blocks``). That exercise is not credited. The
  hidden cases' watch catches the same thing at run time, however the code got hold of it.

Example: ``scan([("L2.1", "alloc_blocks = BlockAllocator.alloc_blocks")], {"L2.1": (target,)})``
with target ``"L2_token_flat.allocator:BlockAllocator.alloc_blocks"`` ->
``[Finding("L2.1", "alias", "reads BlockAllocator.alloc_blocks, the stage's own answer (line 1)")]``.

Left out on purpose: code that hides what it does from a reader (it is caught, if at all, by the
watch), and copying the stage's code by hand into the answer, which is the learner's own work
as far as any grader can tell.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

GRADER_PACKAGE = "kvcourse.grading"  # the grader itself: its cases, hidden cases, gradebook and plugin
GRADER_MODULES = "exercises"  # the stages' checkers and hidden cases (exercises/LN_*/checks.py)
KEY_PACKAGE = "key"  # the answer key: each stage's independent answers (key/LN_*/answers.py)
FORBIDDEN_MODULES = ("importlib", "builtins", "ctypes", "gc")
FORBIDDEN_CALLS = ("exec", "eval", "compile", "__import__")
FORBIDDEN_ATTRIBUTES = ("modules", "settrace", "setprofile", "__code__", "__globals__", "__builtins__")


@dataclass(frozen=True)
class Finding:
    exercise_id: str | None  # the exercise whose cells hold it (None: a cell outside any exercise)
    kind: str  # "tamper" or "alias"
    what: str  # in words, with the line


def scan(cells: list[tuple[str | None, str]], answers: dict[str, tuple[str, ...]]) -> list[Finding]:
    """Findings in the learner's cells, each ``(exercise id or None, source)``; ``answers`` maps an
    exercise to its stage implementation targets (``"module:Qualified.name"``)."""
    findings = []
    trees = []
    for exercise_id, source in cells:
        try:
            trees.append((exercise_id, ast.parse(strip_magics(source))))
        except SyntaxError:
            continue  # it will fail when it runs; nothing to read here
    names = grader_names([tree for _, tree in trees])
    for exercise_id, tree in trees:
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            where = f"line {getattr(node, 'lineno', '?')}"
            tampered = tampering(node, names) or passed_around(node, parents, names)
            if tampered:
                findings.append(Finding(exercise_id, "tamper", f"{tampered} ({where})"))
            for ex, targets in answers.items():
                for target in targets:
                    aliased = aliasing(node, target)
                    if aliased:
                        findings.append(Finding(ex, "alias", f"{aliased}, the stage's own answer ({where})"))
    return findings


def strip_magics(source: str) -> str:
    """IPython lines (``%matplotlib``, ``!ls``) as comments, so the rest parses as Python."""
    return "\n".join("#" + line if line.lstrip()[:1] in ("%", "!") else line for line in source.split("\n"))


def module_names(node) -> list[str]:
    """The modules an import statement names: ``from exercises.L2_token_flat import
    checks`` -> ``["exercises.L2_token_flat", "exercises.L2_token_flat.checks"]``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        return [base] + [f"{base}.{alias.name}".lstrip(".") for alias in node.names]
    return []


def root_name(node) -> str | None:
    """The name an expression starts from: ``checks.check_free.x`` -> ``"checks"``."""
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def grader_names(trees: list) -> set[str]:
    """The names that hold the grader in the learner's code: ``checks`` (the course's setup cell binds
    it), every name an import of ``exercises`` or ``kvcourse.grading`` binds (``from exercises.L3_block_tensor
    import checks as _c``), and every name assigned from one of those (``c = checks``), however far."""
    names = {"checks"}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and any(
                m.split(".")[0] == GRADER_MODULES or m.startswith(GRADER_PACKAGE) for m in module_names(node)
            ):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    while True:
        more = {
            t.id
            for tree in trees
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr) and root_name(node.value) in names
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Name)
        } - names
        if not more:
            return names
        names |= more


def passed_around(node, parents: dict, names: set[str]) -> str | None:
    """A name holding the grader used as a value (``f(checks)``, ``def f(c=checks)``), not called
    through (``checks.check_free(free)``), else None."""
    if isinstance(node, ast.Name) and node.id in names and isinstance(node.ctx, ast.Load):
        if not isinstance(parents.get(node), ast.Attribute):
            return f"passes {node.id} around"
    return None


def tampering(node, names: set[str] = frozenset({"checks"})) -> str | None:
    """What in ``node`` reaches for the grader, the import machinery or the answer key, else None;
    ``names`` hold the grader (``grader_names``).

    Calling a checker (``checks.check_free(free)`` in a scratch cell) is fine; replacing one, rebinding
    ``checks``, or reading anything else of it (``checks.version``: a catch-the-bug exercise's correct
    version, to compare with; ``checks.predict_steps``: the run a prediction is graded against) is not.
    """
    for name in module_names(node):
        parts = name.split(".")
        if (
            name.startswith(GRADER_PACKAGE)
            or parts[0] in (KEY_PACKAGE, GRADER_MODULES)
            or parts[-1] == "answers"
            or parts[0] in FORBIDDEN_MODULES
        ):
            return f"imports {name}"
    if isinstance(node, ast.Name | ast.Attribute | ast.Subscript) and isinstance(
        node.ctx, ast.Store | ast.Del
    ):
        if isinstance(node, ast.Name) and node.id in names:
            return "rebinds checks" if node.id == "checks" else f"binds {node.id} to the grader"
        if root_name(node) in names:
            return f"replaces {ast.unparse(node)}"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id in FORBIDDEN_CALLS:
            return f"calls {node.func.id}()"
        if node.func.id in ("setattr", "delattr") and node.args and root_name(node.args[0]) in names:
            return f"calls {node.func.id}() on {root_name(node.args[0])}"
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in names:
        if not node.attr.startswith("check_"):  # the grader's helpers: a version to compare with, the
            return f"reads {node.value.id}.{node.attr}"  # run a prediction is graded against
    if isinstance(node, ast.Attribute) and node.attr == "grading":
        return f"reaches {ast.unparse(node)}"
    if isinstance(node, ast.Name) and node.id == "__builtins__":
        return "uses __builtins__"
    if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRIBUTES:
        return f"uses .{node.attr}"
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and ".ipynb" in node.value:
        return f"names a notebook file ({node.value!r})"
    return None


def aliasing(node, target: str) -> str | None:
    """How ``node`` takes the stage's own implementation ``target`` (``"module:Class.name"``), else None.

    Examples for ``"L2_token_flat.sequence:allocate_slots"``: ``from L2_token_flat.sequence import allocate_slots``
    and ``sequence.allocate_slots`` are found; ``allocator.allocate_slots(...)`` on an object is not (a method of
    the learner's objects may share the name; the hidden cases' watch sees what actually runs).
    """
    module, _, qualname = target.partition(":")
    *owners, name = qualname.split(".")
    if isinstance(node, ast.ImportFrom) and (node.module or "").endswith(module.split(".")[-1]):
        if not owners and any(alias.name == name for alias in node.names):
            return f"imports {name} from {node.module}"
    if isinstance(node, ast.Attribute) and node.attr == name:
        base = node.value
        if owners and isinstance(base, ast.Name) and base.id == owners[-1]:
            return f"reads {owners[-1]}.{name}"
        if (
            owners
            and isinstance(base, ast.Call)
            and isinstance(base.func, ast.Name)
            and base.func.id == "super"
        ):
            return f"calls super().{name}"
        if not owners and isinstance(base, ast.Name | ast.Attribute):
            dotted = ast.unparse(base)
            if module == dotted or module.endswith("." + dotted):
                return f"reads {dotted}.{name}"
    return None
