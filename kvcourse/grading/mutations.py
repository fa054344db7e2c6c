"""The course's mutation list, and how a catch-the-bug exercise hands a learner's test its bugs.

**The list.** Small, named bugs, each the kind a learner (or a reviewer) could write. Each ``Mutation``
names its file, an exact piece of text that must occur exactly once there, what replaces it, and the
tests that must fail: a slot one off, a block dropped, a partial block shared at a clone, a refcount
that lets go early, a prefix-cache key that forgets its prefix, admission that forgets what running
sequences will still take, a reset skipped, a kernel that forgets to rescale, a comparison that accepts
a short output. A stage's file is named through the harness's stage table (``f"{L2}/allocator.py"``
is ``L2_token_flat/allocator.py``), as everything in grading finds a stage.

Two things use the list: ``make mutants`` (``kvcourse/tools/mutants.py``) puts each bug into a scratch
copy of the course and checks that its tests fail, and the catch-the-bug exercises (below) hand a
learner's test the stage's code with one of these bugs put in.

**Catch the bug.** A catch-the-bug exercise hands the learner's test function a piece of the stage (a
class, such as L2's ``BlockAllocator``, or a function, such as L3's ``allocate_slots``). The test exercises it
and raises (``assert``) when it misbehaves. Grading runs the test on

- the **correct** version: the stage's code, which the test must pass, and
- **buggy** versions: the same code with one bug of the list put in, each of which the test must fail.

Every version, the correct one included, is made the same way: the named definition's source is read
from the stage's file, the bug's text replaced (none for the correct one), and the result executed in
a copy of the module's namespace, under a file name of its own (``<L2_token_flat.allocator, handed to
your test>``). So the versions cannot be told apart by where they come from. The hidden cases also
write every version differently (``refactored``: locals renamed, an unused local added, with a salt
drawn from the seed), so they cannot be told apart by their code either: a test that compares code
(source, bytecode, ``dis``) with the stage's fails the correct version, and a test that runs the
stage's own code as an oracle is seen by the hidden cases' watch (``hidden.watching``), which knows the
stage's code by its fingerprint. Exception classes and everything else the definition uses stay the
module's own (``OutOfBlocksError`` is the class the learner imports).

    bug = mutation("L2 allocator hands out the blocks it has, then raises")
    BuggyAllocator = version("L2_token_flat.allocator:BlockAllocator", bug.name)
    outcome_of(learner_test, BuggyAllocator)   # -> "fails" when the test caught it, "passes" if not

``catch_cases`` makes the visible check cell's cases and ``catch_hidden`` an exercise's ``Hidden``.
A case's line names the bug, never the learner's own message (it must print the same for everyone).

Left out on purpose: generating mutations automatically (mutmut, cosmic-ray: thousands of mutants,
most of them equivalent or trivially caught; these are the bugs the chapters warn about), bugs outside
the list (a bug a learner could not be told about), and partial credit (a test that misses one bug
fails the exercise; the report says which).
"""

from __future__ import annotations

import ast
import functools
import importlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvcourse.grading.cases import Case, first_line
from kvcourse.grading.hidden import Hidden
from kvcourse.harness.stages import STAGES


@dataclass(frozen=True)
class Mutation:
    """One deliberate bug: replace ``old`` (exactly once in ``file``) by ``new``; ``tests`` must fail."""

    name: str
    file: str  # relative to the repository root
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids, relative to the repository root
    needs: str | None = None  # "cpp" (the C++ kernel builds here) or "triton" (triton is installed)


# ==== catch the bug: a learner's test on the correct version and on buggy ones =======================
CORRECT = "the correct version"


def mutation(name: str) -> Mutation:
    """The mutation of ``MUTATIONS`` called ``name`` (a ``KeyError`` names the unknown one)."""
    found = [m for m in MUTATIONS if m.name == name]
    if not found:
        raise KeyError(f"no mutation named {name!r} in kvcourse/grading/mutations.py")
    return found[0]


class Refactor(ast.NodeTransformer):
    """The same code written differently: every local variable of every function renamed (``blocks``
    -> ``blocks_v7``) and an unused local assigned first thing, so the bytecode, the ``dis`` listing
    and the source all differ from the stage's while every call does what it did. Parameters keep
    their names (callers pass them by keyword), and so does a local that a nested function's parameter
    shadows."""

    def __init__(self, salt: int):
        self.suffix = f"_v{salt}"

    def visit_FunctionDef(self, node):  # noqa: N802 - ast's naming
        params = {a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]}
        params |= {a.arg for a in (node.args.vararg, node.args.kwarg) if a is not None}
        declared = {n for s in ast.walk(node) if isinstance(s, ast.Global | ast.Nonlocal) for n in s.names}
        stored = {
            n.id for s in node.body for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
        } | {h.name for s in node.body for h in ast.walk(s) if isinstance(h, ast.ExceptHandler) and h.name}
        nested = {  # a nested function's or lambda's parameter shadows a local of the same name
            a.arg
            for s in node.body
            for f in ast.walk(s)
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            for a in [*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs, f.args.vararg, f.args.kwarg]
            if a is not None
        }
        local = stored - params - declared - nested
        for s in node.body:
            for n in ast.walk(s):
                if isinstance(n, ast.Name) and n.id in local:
                    n.id += self.suffix
                elif isinstance(n, ast.ExceptHandler) and n.name in local:
                    n.name += self.suffix
        first = 1 if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) else 0
        unused = ast.Assign([ast.Name(f"unused{self.suffix}", ast.Store())], ast.Constant(None), lineno=0)
        node.body.insert(first, unused)
        return node

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815


def refactored(source: str, salt: int) -> str:
    """``source`` (one top-level definition) rewritten by ``Refactor``: the same behaviour, other code."""
    return ast.unparse(ast.fix_missing_locations(Refactor(salt).visit(ast.parse(source)))) + "\n"


@functools.cache
def version(target: str, bug_name: str | None = None, salt: int | None = None):
    """The definition ``target`` (``"package.module:Name"``, top level) rebuilt from its source, with
    the mutation ``bug_name`` put in (None: unchanged), and written differently (``refactored``) when
    ``salt`` is given. Each call with the same arguments gives the same object, so a class is built once
    per run.

    Example: ``version("L2_token_flat.allocator:BlockAllocator")(4, 2).alloc_blocks(1) -> [0]``.
    """
    module_name, _, name = target.partition(":")
    module = importlib.import_module(module_name)
    path = Path(module.__file__)
    text = path.read_text(encoding="utf-8")
    if bug_name is not None:
        bug = mutation(bug_name)
        if not path.as_posix().endswith(bug.file):
            raise ValueError(f"mutation {bug_name!r} changes {bug.file}, not {module_name}'s file")
        if text.count(bug.old) != 1:
            raise ValueError(
                f"mutation {bug_name!r}: its text occurs {text.count(bug.old)} times in {bug.file}"
            )
        text = text.replace(bug.old, bug.new)
    nodes = [n for n in ast.parse(text).body if getattr(n, "name", None) == name]
    if len(nodes) != 1:
        raise ValueError(f"{module_name} defines {name} {len(nodes)} times at the top level, not once")
    node = nodes[0]
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    source = "\n" * (start - 1) + "\n".join(text.splitlines()[start - 1 : node.end_lineno]) + "\n"
    if bug_name is not None and bug.new not in source:
        raise ValueError(f"mutation {bug_name!r} changes {module_name} outside {name}")
    if salt is not None:
        source = refactored(source, salt)
    namespace = dict(vars(module))
    exec(compile(source, f"<{module_name}, handed to your test>", "exec"), namespace)  # noqa: S102
    return namespace[name]


def outcome_of(test: Callable, subject) -> str:
    """``"passes"`` when ``test(subject)`` returns, ``"fails"`` when it raises (any exception but
    ``NotImplementedError``, which the exercise's stub raises: it is passed on, so that an untouched
    exercise reads "not done yet" and catches no bug)."""
    try:
        test(subject)
    except NotImplementedError:
        raise
    except Exception:  # noqa: BLE001 - a test may fail with any exception, as under pytest
        return "fails"
    return "passes"


def verdict(want: str, got) -> str | None:
    """A hidden case's difference in words: ``verdict("fails", "passes")`` -> ``"your test passes this
    buggy version: it does not catch the bug"``."""
    if want == got:
        return None
    if got == "passes":
        return "your test passes this buggy version: it does not catch the bug"
    return "your test fails the correct version"


def catch_cases(test: Callable, target: str, bugs: list[str], what: str) -> list[Case]:
    """The check cell's cases: ``test`` on the correct ``target`` (it must pass), then on each of ``bugs``
    (it must fail). ``what`` names the subject in the lines: ``"the allocator"``."""

    def correct() -> str | None:
        try:
            test(version(target))
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001
            return (
                f"your test fails {what} as the stage has it ({type(e).__name__}: {first_line(str(e), 60)})"
            )
        return None

    def buggy(bug: str) -> Callable[[], str | None]:
        def run() -> str | None:
            if outcome_of(test, version(target, bug)) == "passes":
                return f"your test passes {what} with this bug: it does not catch it"
            return None

        return run

    return [Case(f"{CORRECT} of {what}: your test passes", correct)] + [
        Case(f"bug '{bug}': your test fails", buggy(bug)) for bug in bugs
    ]


def catch_hidden(target: str, bugs: list[str], watch: tuple[str, ...]) -> Hidden:
    """The hidden cases of a catch-the-bug exercise: the correct version and every one of ``bugs``, in
    an order drawn from the seed, each written differently (``refactored``, with a salt drawn from the
    seed), so that a test which compares code (source, bytecode, ``dis``) with the stage's instead of
    running it fails the correct version. A case is ``{"bug": name, "salt": n}`` (bug None: the
    correct version); its observation is ``"passes"`` or ``"fails"``, and the independent answer (a
    test that catches them all) passes the first and fails the others. ``watch`` names the stage code
    the learner's test must not run itself (its real methods: an oracle test would)."""

    def draw(rng: random.Random) -> list[dict]:
        cases = [{"bug": None}] + [{"bug": bug} for bug in bugs]
        rng.shuffle(cases)
        return [dict(case, salt=rng.randrange(1, 10**6)) for case in cases]

    def observe(test, case):
        return outcome_of(test, version(target, case["bug"], case.get("salt")))

    def describe(case) -> str:
        return CORRECT if case["bug"] is None else f"bug '{case['bug']}'"

    return Hidden(draw=draw, observe=observe, describe=describe, answers=watch, explain=verdict)


# ==== the list ====================================================================================
L2, L3, L4, L5, L6 = (STAGES[f"L{n}"] for n in range(2, 7))  # the stages' folders: L2 is "L2_token_flat"
P = "tests/test_pressure.py::"
B = "tests/test_l5_beams.py::"
S = "tests/test_shortages.py::"
# (old, new) of L2's and L3's alloc_blocks (the same code in both): hand out what is free, then raise
PARTIAL_GRANT = (
    "        if n > len(self.free_blocks):\n"
    "            raise OutOfBlocksError(needed=n, free=len(self.free_blocks))\n"
    "        blocks = [self.free_blocks.popleft() for _ in range(n)]",
    "        blocks = [self.free_blocks.popleft() for _ in range(min(n, len(self.free_blocks)))]\n"
    "        if len(blocks) < n:\n"
    "            raise OutOfBlocksError(needed=n, free=len(blocks))",
)

MUTATIONS: tuple[Mutation, ...] = (
    # ---- allocation: all or nothing, and blocks for every position
    Mutation(
        "L2 allocator hands out the blocks it has, then raises",
        f"{L2}/allocator.py",
        *PARTIAL_GRANT,
        (S + "test_a_sequence_that_cannot_grow_takes_no_block[L2-part of it free]",),
    ),
    Mutation(
        "L2 allocator hands out blocks from the back of the free list",
        f"{L2}/allocator.py",
        "blocks = [self.free_blocks.popleft() for _ in range(n)]",
        "blocks = [self.free_blocks.pop() for _ in range(n)]",
        ("tests/test_l2.py::test_alloc_and_free_follow_the_free_list",),
    ),
    Mutation(
        "L2 allocator forgets which blocks it handed out",
        f"{L2}/allocator.py",
        "        self.owned.update(blocks)\n        return blocks",
        "        return blocks",
        ("tests/test_l2.py::test_alloc_and_free_follow_the_free_list",),
    ),
    Mutation(
        "L2 free accepts a double free",
        f"{L2}/allocator.py",
        "            if b not in self.owned or b in seen:",
        "            if b in seen:",
        ("tests/test_l2.py::test_free_rejects_unknown_ids_and_double_frees",),
    ),
    Mutation(
        "L2 free gives blocks back before it has checked them all",
        f"{L2}/allocator.py",
        "            seen.add(b)\n        self.owned.difference_update(blocks)\n        self.free_blocks.extend(blocks)",
        "            seen.add(b)\n            self.owned.discard(b)\n            self.free_blocks.append(b)",
        ("tests/test_l2.py::test_free_rejects_unknown_ids_and_double_frees",),
    ),
    Mutation(
        "L2 free puts blocks at the front of the free list",
        f"{L2}/allocator.py",
        "        self.owned.difference_update(blocks)\n        self.free_blocks.extend(blocks)",
        "        self.owned.difference_update(blocks)\n        self.free_blocks.extendleft(blocks)",
        ("tests/test_l2.py::test_alloc_and_free_follow_the_free_list",),
    ),
    Mutation(
        "L3 allocator hands out the blocks it has, then raises",
        f"{L3}/allocator.py",
        *PARTIAL_GRANT,
        (S + "test_a_sequence_that_cannot_grow_takes_no_block[L3-part of it free]",),
    ),
    Mutation(
        "L5 allocator forgets that revived cache hits use up free blocks",
        f"{L5}/allocator.py",
        "if n + revived > len(self.free_blocks):",
        "if n > len(self.free_blocks):",
        (S + "test_l5_failed_allocations_and_clones_take_nothing[revived: they tip it over]",),
    ),
    Mutation(
        "L5 clone copies for the children it can, then runs out",
        f"{L5}/allocator.py",
        "if n * len(partial) > len(self.free_blocks):",
        "if partial and not self.free_blocks:",
        (S + "test_l5_failed_allocations_and_clones_take_nothing[clone: copies for some children only]",),
    ),
    Mutation(
        "L6 allocate_for_seq grants the pages it can (not all or nothing)",
        f"{L6}/page_table.py",
        "want & ok, fresh, seq_table.page_indices)",
        "want & (fresh < refs.shape[0]), fresh, seq_table.page_indices)",
        (S + "test_l6_allocate_for_seq_is_all_or_nothing[part of it free]",),
    ),
    Mutation(
        "L3 allocate_slots drops the block a sequence grows into",
        f"{L3}/sequence.py",
        "    if missing > 0:\n        seq.block_table.extend(allocator.alloc_blocks(missing))",
        "    if missing > 1:\n        seq.block_table.extend(allocator.alloc_blocks(missing))",
        (P + "test_the_smallest_pool_preempts_and_changes_no_token[L3]",),
    ),
    Mutation(
        "L3 slot of a position one row off",
        f"{L3}/sequence.py",
        "* block_size + p % block_size for p in range(start, end)]",
        "* block_size + (p + 1) % block_size for p in range(start, end)]",
        (P + "test_the_smallest_pool_preempts_and_changes_no_token[L3]",),
    ),
    Mutation(
        "L6 over a mesh, one short device does not stop the others allocating",
        f"{L6}/mesh/tables.py",
        "ok = ~jnp.any(short)",
        "ok = ~jnp.all(short)",
        ("tests/test_l6_multihost.py::test_one_short_shard_fails_the_step_and_reports_its_numbers",),
    ),
    Mutation(
        "L6 KV destination of a token one row off",
        f"{L6}/page_table.py",
        "page * ps + token_pos_ids % ps, INVALID)",
        "page * ps + (token_pos_ids + 1) % ps, INVALID)",
        (P + "test_l6_admission_keeps_room_for_what_running_sequences_will_grow_into",),
    ),
    # ---- admission and preemption
    Mutation(
        "L6 admission forgets the pages running sequences will still take",
        f"{L6}/engine.py",
        "spare -= cdiv(int(seqs.seq_lens[s]) + left, ps) - int(held[s])",
        "spare -= 0",
        (P + "test_l6_admission_keeps_room_for_what_running_sequences_will_grow_into",),
    ),
    Mutation(
        "L3 preemption keeps the blocks of the victim",
        f"{L3}/scheduler.py",
        "        self.running.remove(seq)\n        self.allocator.free(seq.block_table)\n",
        "        self.running.remove(seq)\n",
        (P + "test_the_smallest_pool_preempts_and_changes_no_token[L3]",),
    ),
    Mutation(
        "L3 preemption forgets to reset what the victim computed",
        f"{L3}/scheduler.py",
        "        seq.num_computed_tokens = 0\n        self.add(seq)",
        "        self.add(seq)",
        (P + "test_the_smallest_pool_preempts_and_changes_no_token[L3]",),
    ),
    Mutation(
        "L3 preempts the most important sequence instead of the least",
        f"{L3}/scheduler.py",
        "victim = self.running[-1]  # lowest priority, newest",
        "victim = self.running[0]  # lowest priority, newest",
        ("tests/test_l3.py::test_preemption_spares_the_higher_priority",),
    ),
    Mutation(
        "L4 preemption forgets to reset what the victim computed",
        f"{L4}/scheduler.py",
        "        seq.num_computed_tokens = 0\n        self.add(seq)",
        "        self.add(seq)",
        (P + "test_the_smallest_pool_preempts_and_changes_no_token[L4-splits3]",),
    ),
    Mutation(
        "L5 preemption forgets to reset what the victim computed",
        f"{L5}/scheduler.py",
        "            s.num_computed_tokens = 0\n            self.add(s)",
        "            self.add(s)",
        (P + "test_the_smallest_pool_preempts_and_changes_no_token[L5]",),
    ),
    Mutation(
        "L3 admits waiting sequences in a step that preempted",
        f"{L3}/scheduler.py",
        "            return batch  # memory is tight: admit nobody this step",
        "            pass  # memory is tight: admit nobody this step",
        ("tests/test_l3.py::test_a_step_that_preempts_admits_nobody",),
    ),
    Mutation(
        "L5 admits waiting sequences in a step that preempted",
        f"{L5}/scheduler.py",
        "            return batch  # memory is tight: admit nobody this step",
        "            pass  # memory is tight: admit nobody this step",
        ("tests/test_l5.py::test_a_step_that_preempts_admits_nobody",),
    ),
    Mutation(
        "L5 a request with n samples takes one seat",
        f"{L5}/scheduler.py",
        "self.num_running_seqs() + self.waiting[0].num_seqs <= self.config.max_num_seqs",
        "self.num_running_seqs() + 1 <= self.config.max_num_seqs",
        ("tests/test_l5.py::test_samples_count_against_max_num_seqs",),
    ),
    Mutation(
        "L3 a finished sequence keeps its blocks",
        f"{L3}/scheduler.py",
        "        (self.running if seq.status is Status.RUNNING else self.waiting).remove(seq)\n"
        "        self.allocator.free(seq.block_table)\n",
        "        (self.running if seq.status is Status.RUNNING else self.waiting).remove(seq)\n",
        (P + "test_the_smallest_pool_preempts_and_changes_no_token[L3]",),
    ),
    Mutation(
        "L3 admission ignores max_num_seqs",
        f"{L3}/scheduler.py",
        "while self.waiting and len(self.running) < self.config.max_num_seqs:",
        "while self.waiting:",
        ("tests/test_l3.py::test_max_num_seqs_caps_the_running_set",),
    ),
    # ---- sharing: refcounts, clones, copies
    Mutation(
        "L5 clone shares the partial block instead of copying it",
        f"{L5}/allocator.py",
        "full = num_tokens // self.block_size",
        "full = blocks_needed(num_tokens, self.block_size)",
        (P + "test_sampled_clones_sharing_blocks_equal_independent_requests",),
    ),
    Mutation(
        "L5 free lets go of a shared block when its first owner finishes",
        f"{L5}/allocator.py",
        "            self.blocks[b].ref_count -= 1\n",
        "            self.blocks[b].ref_count = 0\n",
        (P + "test_sampled_clones_sharing_blocks_equal_independent_requests",),
    ),
    Mutation(
        "L5 clone takes one reference on a shared block for all its children",
        f"{L5}/allocator.py",
        "            self.blocks[b].ref_count += n",
        "            self.blocks[b].ref_count += 1",
        (P + "test_sampled_clones_sharing_blocks_equal_independent_requests",),
    ),
    Mutation(
        "L5 free hands a block table back head first",
        f"{L5}/allocator.py",
        "        for b in reversed(blocks):",
        "        for b in blocks:",
        ("tests/test_l5.py::test_refcounts_through_alloc_share_and_free",),
    ),
    Mutation(
        "L5 clone skips the copy of the partial block's K/V",
        f"{L5}/engine.py",
        "            self.pool.copy_block(src, dst)\n        return done",
        "            pass\n        return done",
        ("tests/test_l5.py::test_greedy_and_greedy_clones_equal_l4_and_hf[default]",),
    ),
    # ---- beam search: forks and drops of block tables
    Mutation(
        "L5 a dropped beam keeps its blocks",
        f"{L5}/beams/fork.py",
        "            allocator.free(table)\n",
        "            pass\n",
        (B + "test_widths_1_to_6_equal_hf_on_the_tiny_qwen3[4-3]",),
    ),
    Mutation(
        "L5 a surviving beam copies its parent's blocks instead of sharing them",
        f"{L5}/beams/fork.py",
        "            [table], copy = allocator.clone(tables[j], num_tokens, 1)\n",
        "            table = allocator.alloc_blocks(len(tables[j]))\n"
        "            copy = list(zip(tables[j], table, strict=True))\n",
        (B + "test_widths_1_to_6_equal_hf_on_the_tiny_qwen3[4-3]",),
    ),
    Mutation(
        "L5 a surviving beam shares its parent's partial block, which both then write",
        f"{L5}/beams/fork.py",
        "            [table], copy = allocator.clone(tables[j], num_tokens, 1)\n",
        "            table, copy = list(tables[j]), []\n"
        "            for b in table:\n"
        "                allocator.blocks[b].ref_count += 1\n",
        (B + "test_widths_1_to_6_equal_hf_on_the_tiny_qwen3[4-3]",),
    ),
    Mutation(
        "L5 block copy copies K only",
        f"{L5}/cache.py",
        "        self.v[:, dst] = self.v[:, src]",
        "        pass",
        (P + "test_sampled_clones_sharing_blocks_equal_independent_requests",),
    ),
    Mutation(
        "L6 clone skips the copy of the partial page's K/V",
        f"{L6}/decode_state.py",
        "return start_clone(state, seqs, pages, parent, child, ok), copy_page(kv_pages, src, dst)",
        "return start_clone(state, seqs, pages, parent, child, ok), kv_pages",
        ("tests/test_l6_engine.py::test_clones_share_full_pages",),
    ),
    Mutation(
        "L6 clone shares the partial page too",
        f"{L6}/page_table.py",
        "    n_full = length // ps\n",
        "    n_full = cdiv(length, ps)\n",
        ("tests/test_l6_state.py::test_free_and_clone_docstring_examples",),
    ),
    Mutation(
        "L6 clone takes no reference on the pages it shares",
        f"{L6}/page_table.py",
        'refs = refs.at[jnp.where(shared, row, n_pages)].add(1, mode="drop")',
        'refs = refs.at[jnp.where(shared, row, n_pages)].add(0, mode="drop")',
        (P + "test_l6_on_the_smallest_pool_changes_no_token[incremental]",),
    ),
    # ---- prefix cache: the chained hash
    Mutation(
        "L5 block key forgets the previous block's key",
        f"{L5}/prefix_cache.py",
        'text = f"{prev_hash}|',
        'text = f"{None}|',
        (P + "test_equal_blocks_after_other_prefixes_do_not_hit",),
    ),
    Mutation(
        "L5 blocks are registered under unchained keys",
        f"{L5}/prefix_cache.py",
        "prev = allocator.blocks[block_table[i - 1]].hash if i else None",
        "prev = None",
        (P + "test_equal_blocks_after_other_prefixes_do_not_hit",),
    ),
    Mutation(
        "L5 match_prefix looks blocks up under unchained keys",
        f"{L5}/prefix_cache.py",
        "        key = block_hash(key, tokens)",
        "        key = block_hash(None, tokens)",
        (P + "test_equal_blocks_after_other_prefixes_do_not_hit",),
    ),
    Mutation(
        "L5 a key hit is taken without checking the block's tokens",
        f"{L5}/allocator.py",
        "if b is None or self.blocks[b].token_ids != tuple(token_ids):",
        "if b is None:",
        ("tests/test_l5.py::test_a_hash_hit_with_other_tokens_is_a_miss",),
    ),
    Mutation(
        "L5 a reused block keeps its old key in the index",
        f"{L5}/allocator.py",
        "            del self.hash_to_block[block.hash]",
        "            pass",
        ("tests/test_l5.py::test_lru_allocation_forgets_the_oldest_freed_blocks_first",),
    ),
    Mutation(
        "L5 match_prefix takes the block of the last token",
        f"{L5}/prefix_cache.py",
        "for i in range((len(token_ids) - 1) // bs):",
        "for i in range(len(token_ids) // bs):",
        ("tests/test_l5.py::test_match_prefix_never_takes_the_block_of_the_last_token",),
    ),
    # ---- L6 reset and cleanup
    Mutation(
        "L6 reset skipped unless cleanup is none",
        f"{L6}/engine.py",
        "self.state = self._reset_logical(self.state)",
        'self.state = self._reset_logical(self.state) if self.cleanup == "none" else self.state',
        (P + "test_l6_two_calls_in_a_row_start_from_a_reset_state[incremental-logical]",),
    ),
    Mutation(
        "L6 physical reset keeps the K/V pages",
        f"{L6}/engine.py",
        'if self.reset_mode == "physical":',
        'if self.reset_mode == "never":',
        (P + "test_l6_two_calls_in_a_row_start_from_a_reset_state[incremental-physical]",),
    ),
    Mutation(
        "L6 incremental cleanup frees nothing in the decode loop",
        f"{L6}/engine.py",
        "new = ds.free_finished(new)  # pages return the step a sequence finishes",
        "new = new  # pages return the step a sequence finishes",
        (P + "test_l6_on_the_smallest_pool_changes_no_token[incremental]",),
    ),
    Mutation(
        "L6 end cleanup frees nothing between host calls",
        f"{L6}/engine.py",
        'if self.cleanup == "end" and (host.finished & host.sequences.used_mask).any():',
        'if self.cleanup == "never" and (host.finished & host.sequences.used_mask).any():',
        (P + "test_l6_on_the_smallest_pool_changes_no_token[end]",),
    ),
    Mutation(
        "L6 a sequence that finishes on its prefill token keeps its pages",
        f"{L6}/engine.py",
        "state = ds.free_finished(state)  # a sequence can end on its prefill token (eos, max_new_tokens 1)",
        "state = state  # a sequence can end on its prefill token (eos, max_new_tokens 1)",
        ("tests/test_l6_engine.py::test_incremental_cleanup_frees_sequences_that_finish_at_prefill",),
    ),
    Mutation(
        "L6 freeing a finished slot leaves its refcounts",
        f"{L6}/page_table.py",
        '.add(-1, mode="drop")',
        '.add(0, mode="drop")',
        (P + "test_l6_two_calls_in_a_row_start_from_a_reset_state[end-logical]",),
    ),
    # ---- kernels
    Mutation(
        "L4 PyTorch kernel forgets to rescale acc",
        f"{L4}/paged_attention.py",
        "alpha[..., None] * acc + p @ v",
        "acc + p @ v",
        ("tests/test_l4_kernels.py::test_torch_kernel_matches_dense",),
    ),
    Mutation(
        "L4 PyTorch kernel lets a query see the key after it",
        f"{L4}/paged_attention.py",
        's = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))',
        's = s.masked_fill(k_pos[None, :] > q_pos[:, None] + 1, float("-inf"))',
        ("tests/test_l4_kernels.py::test_torch_kernel_matches_dense",),
    ),
    Mutation(
        "L4 split-KV reduce forgets to rescale the denominators",
        f"{L4}/fast/split_kv.py",
        "/ (w * l).sum(dim=0)[..., None]",
        "/ l.sum(dim=0)[..., None]",
        ("tests/test_l4_kernels.py::test_split_kv_matches_dense",),
    ),
    Mutation(
        "L4 PyTorch kernel reads the block table's padding",
        f"{L4}/paged_attention.py",
        "blocks = block_tables[s, : (ctx + block_size - 1) // block_size].tolist()",
        "blocks = block_tables[s].tolist()",
        ("tests/test_l4_kernels.py::test_torch_kernel_matches_dense",),
    ),
    Mutation(
        "L4 Triton kernel forgets to rescale acc",
        f"{L4}/fast/triton_paged_attention.py",
        "acc = acc * alpha[:, None] + tl.dot(p, v",
        "acc = acc + tl.dot(p, v",
        ("tests/test_l4_kernels.py::test_triton_kernel_matches_dense",),
        needs="triton",
    ),
    Mutation(
        "L4 Triton kernel's query tile runs past its sequence's last token",
        f"{L4}/fast/triton_paged_attention.py",
        "row_mask = (rows < BLOCK_Q * G) & (tok < q_len)",
        "row_mask = rows < BLOCK_Q * G",
        ("tests/test_l4_kernels.py::test_each_output_row_is_written_once_by_its_own_tile",),
        needs="triton",
    ),
    Mutation(
        "L4 C++ kernel forgets to rescale acc",
        f"{L4}/fast/paged_attention.cpp",
        "for (int64_t x = 0; x < d; ++x) a[x] *= alpha;",
        "for (int64_t x = 0; x < d; ++x) a[x] *= 1.f;",
        ("tests/test_l4_kernels.py::test_cpp_kernel_matches_dense",),
        needs="cpp",
    ),
    Mutation(
        "L4 PyTorch kernel hides a query's own key",
        f"{L4}/paged_attention.py",
        's = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))',
        's = s.masked_fill(k_pos[None, :] >= q_pos[:, None], float("-inf"))',
        ("tests/test_l4_kernels.py::test_torch_kernel_matches_dense",),
    ),
    Mutation(
        "L4 PyTorch kernel counts every block's key positions from 0",
        f"{L4}/paged_attention.py",
        "k_pos = j * block_size + torch.arange(block_size, device=q.device)",
        "k_pos = torch.arange(block_size, device=q.device)",
        ("tests/test_l4_kernels.py::test_torch_kernel_matches_dense",),
    ),
    Mutation(
        "L4 PyTorch kernel reads block j of the pool, not the table's j-th block",
        f"{L4}/paged_attention.py",
        "for j, block in enumerate(blocks):",
        "for j, block in enumerate(range(len(blocks))):",
        ("tests/test_l4_kernels.py::test_torch_kernel_matches_dense",),
    ),
    Mutation(
        "L4 PyTorch kernel forgets the scale",
        f"{L4}/paged_attention.py",
        's = torch.einsum("hgqd,hkd->hgqk", q, k) * scale',
        's = torch.einsum("hgqd,hkd->hgqk", q, k)',
        ("tests/test_l4_kernels.py::test_torch_kernel_matches_dense",),
    ),
    Mutation(
        "L5 beam scores made on the default device (the first GPU run's bug)",
        f"{L5}/beams/__init__.py",
        "scores = torch.zeros(1, device=engine.device)",
        "scores = torch.zeros(1)",
        ("tests/test_devices.py::test_every_smoke_path_makes_nothing_on_the_default_device[L5]",),
    ),
    Mutation(
        "L6 RoPE table's positions made on the default device",
        "kvcourse/jax_model.py",
        'torch.arange(cfg.max_position_embeddings, device="cpu")',
        "torch.arange(cfg.max_position_embeddings)",
        ("tests/test_devices.py::test_the_l6_engine_makes_nothing_on_the_default_device",),
    ),
    Mutation(
        "L6 reference attention forgets to rescale acc",
        f"{L6}/attention.py",
        "alpha[..., None] * acc + jnp.einsum(pv, p, v, precision=HIGHEST)",
        "acc + jnp.einsum(pv, p, v, precision=HIGHEST)",
        ("tests/test_l6_attention.py::test_ragged_paged_attention_equals_dense",),
    ),
    Mutation(
        "L6 reference attention lets a query see the key after it",
        f"{L6}/attention.py",
        "visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < context_len)",
        "visible = (k_pos[None, :] <= q_pos[:, None] + 1) & (k_pos[None, :] < context_len)",
        ("tests/test_l6_attention.py::test_ragged_paged_attention_equals_dense",),
    ),
    Mutation(
        "L6 decode attention reads one key past the sequence",
        f"{L6}/attention.py",
        "visible = j * span + jnp.arange(span)[None, :] < context_len[:, None]",
        "visible = j * span + jnp.arange(span)[None, :] <= context_len[:, None]",
        ("tests/test_l6_attention.py::test_decode_only_paged_attention_equals_dense",),
    ),
    Mutation(
        "L6 KV write of a padding token wraps round to the last page",
        f"{L6}/kv_cache.py",
        "where = jnp.where(dests >= 0, dests, n_pages * ps)",
        "where = dests",
        ("tests/test_l6_attention.py::test_update_kv_is_one_scatter_to_page_and_row",),
    ),
    # ---- L6 allocate_for_seq (exercise L6.7 hands a learner's test these)
    Mutation(
        "L6 allocate_for_seq takes no reference on a new page",
        f"{L6}/page_table.py",
        'refs = refs.at[jnp.where(want & ok, fresh, n_pages)].add(1, mode="drop")',
        'refs = refs.at[jnp.where(want & ok, fresh, n_pages)].add(0, mode="drop")',
        ("tests/test_l6_state.py::test_allocate_for_seq_docstring_example",),
    ),
    Mutation(
        "L6 allocate_for_seq grows a slot to its last position, one token short",
        f"{L6}/page_table.py",
        '.max(token_pos_ids + 1, mode="drop")',
        '.max(token_pos_ids, mode="drop")',
        ("tests/test_l6_state.py::test_allocate_for_seq_docstring_example",),
    ),
    Mutation(
        "L6 allocate_for_seq hands out the highest free page first",
        f"{L6}/page_table.py",
        "free_ids = jnp.nonzero(refs == 0, size=n_pages, fill_value=n_pages)[0]",
        "free_ids = n_pages - 1 - jnp.nonzero(jnp.flip(refs == 0), size=n_pages, fill_value=-1)[0]",
        ("tests/test_l6_state.py::test_allocate_for_seq_docstring_example",),
    ),
    Mutation(
        "L6 allocate_for_seq does not count page 0 among the pages a slot holds",
        f"{L6}/page_table.py",
        "have = jnp.sum(seq_table.page_indices >= 0, axis=1)",
        "have = jnp.sum(seq_table.page_indices > 0, axis=1)",
        ("tests/test_l6_state.py::test_allocate_for_seq_docstring_example",),
    ),
    Mutation(
        "L6 allocate_for_seq counts the pages a slot needs with floor division",
        f"{L6}/page_table.py",
        "need = cdiv(new_lens, ps)  # (S,) pages needed",
        "need = new_lens // ps  # (S,) pages needed",
        ("tests/test_l6_state.py::test_allocate_for_seq_docstring_example",),
    ),
    Mutation(
        "decode graphs' padding rows write their K/V into block 0, which a sequence owns",
        "kvcourse/decode_graphs.py",
        "self.slot_mapping[b:size] = padding_block * self.block_size",
        "self.slot_mapping[b:size] = 0",
        ("tests/test_decode_graphs.py::test_decode_graphs_equal_hf_and_the_readable_path",),
    ),
    # ---- the comparison every smoke relies on
    Mutation(
        "a comparison that accepts a short output",
        "kvcourse/harness/compare.py",
        "return None if len(a) == len(b) else min(len(a), len(b))",
        "return None",
        ("tests/test_smokes.py::test_smoke_fails_an_engine_that_is_wrong[short output]",),
    ),
    Mutation(
        "a comparison that calls a missing token a numerical tie",
        "kvcourse/harness/compare.py",
        "if picked_both and hf_text and",
        "if hf_text and",
        ("tests/test_prompts_compare.py::test_a_missing_token_is_never_a_tie",),
    ),
)
