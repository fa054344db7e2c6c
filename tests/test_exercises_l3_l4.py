"""The L3 and L4 exercise checkers can fail and can pass, in process, without running a notebook.

For every exercise (L3.1 slots, L3.2 plan_step, L3.3 preempt, L3.4 admitted, L4.1 merge, L4.2 attend_blocks, L4.3
kv_splits):

- plausible wrong answers (an off-by-one, the wrong victim, a missing reset, a forgotten rescale, the
  wrong block index, ...) fail: the summary line is not ``n/n passed`` and the case built to catch the
  mistake is reported ``WRONG`` or ``raised``;
- the same wrong answers fail the hidden cases the grader draws (``kvcourse/grading/hidden.py``), on three
  seeds each;
- the reference solution of the reference notebook (the code between its solution markers, run as the
  notebook runs it) passes every case, and so does the independent answer of each stage's
  ``answers.py``. The checkers' references are the stages' own code (``slots``, ``Scheduler``,
  ``merge_partials``, ``attend_blocks``, ``split_kv_attention``), so the answers and the stage hold each
  other in check; the stage's code is also checked on worked examples with hand-computed results
  (here, and in ``test_l3.py`` and ``test_l4_kernels.py``).

Every checker here runs on tiny tensors and hand-built queues: no model is loaded. The grader's
end-to-end runs over whole notebooks are in ``test_grading.py``.
"""

from __future__ import annotations

import re
from bisect import insort
from pathlib import Path

import nbformat
import pytest
import torch
from checker_asserts import assert_fails_hidden

from exercises.L3_block_tensor import checks as l3_checks
from exercises.L4_paged_kernel import checks as l4_checks
from key.L3_block_tensor import answers as l3_answers
from key.L4_paged_kernel import answers as l4_answers
from L3_block_tensor.sequence import Sequence, Status, slots
from L4_paged_kernel.fast.split_kv import merge_partials
from L4_paged_kernel.paged_attention import attend_blocks

NOTEBOOKS = Path(__file__).resolve().parent.parent / "key" / "notebooks"
SUMMARY_RE = re.compile(r"^(\d+)/(\d+) passed$")


def graded(capsys, checker, fn) -> tuple[list[str], int, int]:
    """Run one checker on ``fn``; its printed lines, and the passed and total counts of its summary."""
    checker(fn)
    lines = capsys.readouterr().out.strip().splitlines()
    summary = SUMMARY_RE.match(lines[-1])
    assert summary, f"no 'k/n passed' summary line:\n{lines}"
    return lines, int(summary[1]), int(summary[2])


def reference_solution(notebook: str, name: str):
    """The function ``name`` as the reference notebook defines it: its whole cell, markers and all, run
    with what the setup cell would have imported (torch)."""
    nb = nbformat.read(str(NOTEBOOKS / notebook), as_version=4)
    sources = [
        c.source
        for c in nb.cells
        if c.cell_type == "code" and f"def {name}(" in c.source and "# BEGIN SOLUTION" in c.source
    ]
    assert len(sources) == 1, f"{notebook}: {len(sources)} solution cells define {name}"
    namespace = {"torch": torch}
    exec(compile(sources[0], f"{notebook}:{name}", "exec"), namespace)
    return namespace[name]


# ---------------------------------------------------------------------------------------------------
# L3.1 slots


def slots_off_by_one(block_table, start, end, block_size):
    return [block_table[(t + 1) // block_size] * block_size + (t + 1) % block_size for t in range(start, end)]


def slots_logical_block(block_table, start, end, block_size):
    return [(t // block_size) * block_size + t % block_size for t in range(start, end)]  # ignores the table


def slots_end_inclusive(block_table, start, end, block_size):
    return [block_table[t // block_size] * block_size + t % block_size for t in range(start, end + 1)]


# ---------------------------------------------------------------------------------------------------
# L3.2 plan_step


def cut(todo, budget, prefill_chunk_size):
    """The right per-request cut (chunk and budget; all or nothing without chunking)."""
    if prefill_chunk_size is None:
        return todo if todo <= budget else 0
    return min(todo, prefill_chunk_size, budget)


def plan_ignores_max_num_seqs(running, waiting, max_num_batched_tokens, prefill_chunk_size, max_num_seqs):
    budget, run_n, wait_n = max_num_batched_tokens, [], [0] * len(waiting)
    for todo in running:
        run_n.append(cut(todo, budget, prefill_chunk_size) if budget > 0 else 0)
        budget -= run_n[-1]
    for i, todo in enumerate(waiting):  # wrong: admits past max_num_seqs
        n = cut(todo, budget, prefill_chunk_size)
        if n == 0:
            break
        wait_n[i], budget = n, budget - n
    return run_n, wait_n


def plan_jumps_the_queue(running, waiting, max_num_batched_tokens, prefill_chunk_size, max_num_seqs):
    budget, run_n, wait_n = max_num_batched_tokens, [], [0] * len(waiting)
    for todo in running:
        run_n.append(cut(todo, budget, prefill_chunk_size) if budget > 0 else 0)
        budget -= run_n[-1]
    num_running = len(running)
    for i, todo in enumerate(waiting):
        n = cut(todo, budget, prefill_chunk_size)
        if num_running >= max_num_seqs:
            break
        if n == 0:
            continue  # wrong: a later, shorter prompt is admitted past the one that did not fit
        wait_n[i], budget, num_running = n, budget - n, num_running + 1
    return run_n, wait_n


# ---------------------------------------------------------------------------------------------------
# L3.3 preempt


def preempt_oldest(running, waiting, allocator):
    victim = running.pop(0)  # wrong victim: the front of the scheduling order
    allocator.free(victim.block_table)
    victim.block_table, victim.num_computed_tokens, victim.status = [], 0, Status.WAITING
    insort(waiting, victim, key=Sequence.sort_key)
    return victim


def preempt_newest_id(running, waiting, allocator):
    victim = max(running, key=lambda s: s.request_id)  # wrong: ignores priority
    running.remove(victim)
    allocator.free(victim.block_table)
    victim.block_table, victim.num_computed_tokens, victim.status = [], 0, Status.WAITING
    insort(waiting, victim, key=Sequence.sort_key)
    return victim


def preempt_appends_to_waiting(running, waiting, allocator):
    victim = running.pop()
    allocator.free(victim.block_table)
    victim.block_table, victim.num_computed_tokens, victim.status = [], 0, Status.WAITING
    waiting.append(victim)  # wrong: behind requests that arrived after it
    return victim


def preempt_keeps_computed(running, waiting, allocator):
    victim = running.pop()
    allocator.free(victim.block_table)
    victim.block_table, victim.status = [], Status.WAITING  # missing: num_computed_tokens = 0
    insort(waiting, victim, key=Sequence.sort_key)
    return victim


def preempt_drops_output(running, waiting, allocator):
    victim = running.pop()
    allocator.free(victim.block_table)
    victim.block_table, victim.num_computed_tokens, victim.status = [], 0, Status.WAITING
    victim.output_ids = []  # wrong: the generated tokens are the request's, not a cache
    insort(waiting, victim, key=Sequence.sort_key)
    return victim


def preempt_frees_reversed(running, waiting, allocator):
    victim = running.pop()
    allocator.free(victim.block_table[::-1])  # wrong order on the free list
    victim.block_table, victim.num_computed_tokens, victim.status = [], 0, Status.WAITING
    insort(waiting, victim, key=Sequence.sort_key)
    return victim


def preempt_bypasses_allocator(running, waiting, allocator):
    victim = running.pop()
    allocator.free_blocks.extend(victim.block_table)  # wrong: the allocator still counts them as owned
    victim.block_table, victim.num_computed_tokens, victim.status = [], 0, Status.WAITING
    insort(waiting, victim, key=Sequence.sort_key)
    return victim


# ---------------------------------------------------------------------------------------------------
# L4.1 merge


def merge_without_rescale(m1, l1, acc1, m2, l2, acc2):
    return (acc1 + acc2) / (l1 + l2)[:, None]  # forgotten rescale to the common max


def merge_exp_of_max(m1, l1, acc1, m2, l2, acc2):
    w1, w2 = torch.exp(m1), torch.exp(m2)  # overflows for large scores
    return (w1[:, None] * acc1 + w2[:, None] * acc2) / (w1 * l1 + w2 * l2)[:, None]


# ---------------------------------------------------------------------------------------------------
# L4.2 attend_blocks


def block_loop(q, k_pool, v_pool, blocks, q_pos, scale, *, rescale_acc=True, offset=True, mask=True):
    """The block loop with one mistake switched on: no rescale of acc, block index not in the key
    positions, or no mask at all."""
    n_q, d = q.shape
    block_size = k_pool.shape[1]
    m, l, acc = torch.full((n_q,), float("-inf")), torch.zeros(n_q), torch.zeros(n_q, d)
    for j, block in enumerate(blocks):
        s = (q @ k_pool[block].T) * scale  # (Tq, block_size)
        k_pos = (j * block_size if offset else 0) + torch.arange(block_size)
        if mask:
            s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))
        p, alpha = torch.exp(s - m_new[:, None]), torch.exp(m - m_new)
        l = alpha * l + p.sum(dim=-1)
        acc = (alpha[:, None] * acc if rescale_acc else acc) + p @ v_pool[block]
        m = m_new
    return acc / l[:, None]


def attend_without_acc_rescale(q, k_pool, v_pool, blocks, q_pos, scale):
    return block_loop(q, k_pool, v_pool, blocks, q_pos, scale, rescale_acc=False)


def attend_positions_without_block_index(q, k_pool, v_pool, blocks, q_pos, scale):
    return block_loop(q, k_pool, v_pool, blocks, q_pos, scale, offset=False)


def attend_unmasked(q, k_pool, v_pool, blocks, q_pos, scale):
    return block_loop(q, k_pool, v_pool, blocks, q_pos, scale, mask=False)


# ---------------------------------------------------------------------------------------------------
# L4.3 kv_splits


def splits_floor(block_table, context_len, block_size, num_splits):
    n_blocks = -(-context_len // block_size)
    per_split = max(n_blocks // num_splits, 1)  # wrong: floor leaves a remainder for an extra split
    splits = []
    for f in range(0, n_blocks, per_split):
        last = min(f + per_split, n_blocks)
        splits.append((f, block_table[f:last], min(last * block_size, context_len) - f * block_size))
    return splits


def splits_unmasked_last_block(block_table, context_len, block_size, num_splits):
    n_blocks = -(-context_len // block_size)
    per_split = -(-n_blocks // num_splits)
    return [
        (f, block_table[f : min(f + per_split, n_blocks)], (min(f + per_split, n_blocks) - f) * block_size)
        for f in range(0, n_blocks, per_split)
    ]  # every row counted, the stale rows of the last block too


def splits_balanced(block_table, context_len, block_size, num_splits):
    n_blocks = -(-context_len // block_size)
    sizes = [n_blocks // num_splits + (i < n_blocks % num_splits) for i in range(num_splits)]
    splits, first = [], 0
    for size in sizes:  # wrong: np.array_split's cut, not the kernel's
        if size:
            last = first + size
            splits.append(
                (first, block_table[first:last], min(last * block_size, context_len) - first * block_size)
            )
            first = last
    return splits


def splits_first_block_zero(block_table, context_len, block_size, num_splits):
    n_blocks = -(-context_len // block_size)
    per_split = -(-n_blocks // num_splits)
    splits = []
    for f in range(0, n_blocks, per_split):
        last = min(f + per_split, n_blocks)
        splits.append((0, block_table[f:last], min(last * block_size, context_len) - f * block_size))
    return splits  # wrong: every split's first logical block given as 0


def splits_logical_ids(block_table, context_len, block_size, num_splits):
    n_blocks = -(-context_len // block_size)
    per_split = -(-n_blocks // num_splits)
    splits = []
    for f in range(0, n_blocks, per_split):
        last = min(f + per_split, n_blocks)
        splits.append((f, list(range(f, last)), min(last * block_size, context_len) - f * block_size))
    return splits  # wrong: logical block indices, not the table's physical ids


def _admitted(policy, requests, num_blocks, block_size, max_model_len, held_of, stop=True, runs=True):
    """L3.4 worked by hand, with a mistake switched in: ``held_of`` (positions held at admission),
    ``stop=False`` (skips a request that does not fit), ``runs=False`` (an Orca reservation as loose
    blocks, not one buddy run of a power of two of blocks)."""
    free, count = num_blocks, 0
    for prompt_len, max_new in requests:
        blocks = -(-held_of(policy, prompt_len, max_new, max_model_len) // block_size)
        if runs and policy != "on_demand":
            blocks = 1 << (blocks - 1).bit_length()
        if blocks > free:
            if stop:
                break
            continue
        free -= blocks
        count += 1
    return count


def _held(policy, prompt_len, max_new, max_model_len):
    pow2 = prompt_len + min(1 << (max_new - 1).bit_length(), max_model_len - prompt_len)
    held = {"on_demand": prompt_len, "oracle": prompt_len + max_new, "pow2": pow2, "max": max_model_len}
    return held[policy]


def admitted_pow2_uncapped(policy, requests, num_blocks, block_size, max_model_len):
    def held(p, prompt_len, max_new, m):  # wrong: pow2 past max_model_len
        if p == "pow2":
            return prompt_len + (1 << (max_new - 1).bit_length())
        return _held(p, prompt_len, max_new, m)

    return _admitted(policy, requests, num_blocks, block_size, max_model_len, held)


def admitted_pow2_rounds_prompt_too(policy, requests, num_blocks, block_size, max_model_len):
    def held(p, prompt_len, max_new, m):  # wrong: the old rule, next_pow2(prompt + output)
        if p == "pow2":
            return min(1 << (prompt_len + max_new - 1).bit_length(), m)
        return _held(p, prompt_len, max_new, m)

    return _admitted(policy, requests, num_blocks, block_size, max_model_len, held)


def admitted_loose_blocks(policy, requests, num_blocks, block_size, max_model_len):
    # wrong: an Orca reservation taken as loose blocks, not one run of a power of two
    return _admitted(policy, requests, num_blocks, block_size, max_model_len, _held, runs=False)


def admitted_on_demand_whole_length(policy, requests, num_blocks, block_size, max_model_len):
    def held(p, prompt_len, max_new, m):  # wrong: on_demand holds it all
        return prompt_len + max_new if p == "on_demand" else _held(p, prompt_len, max_new, m)

    return _admitted(policy, requests, num_blocks, block_size, max_model_len, held)


def admitted_jumps_the_queue(policy, requests, num_blocks, block_size, max_model_len):
    return _admitted(policy, requests, num_blocks, block_size, max_model_len, _held, stop=False)  # skips ahead


WRONG = [
    # (checker, wrong answer, the name of a case that must catch it)
    (l3_checks.check_admitted, admitted_pow2_uncapped, "pow2 never past max_model_len"),
    (
        l3_checks.check_admitted,
        admitted_pow2_rounds_prompt_too,
        "pow2 rounds the output only: 6 + 16 positions",
    ),
    (l3_checks.check_admitted, admitted_loose_blocks, "oracle: 10 positions are 3 blocks, a run of 4"),
    (l3_checks.check_admitted, admitted_on_demand_whole_length, "on_demand holds a prompt's blocks only"),
    (
        l3_checks.check_admitted,
        admitted_jumps_the_queue,
        "oracle, mixed lengths: the first that does not fit stops the rest",
    ),
    (l3_checks.check_slots, slots_off_by_one, "block table [7, 2], block_size 4, positions 2..5"),
    (l3_checks.check_slots, slots_logical_block, "a whole prefill: [3, 0, 5], block_size 4, positions 0..9"),
    (l3_checks.check_slots, slots_end_inclusive, "no positions (start == end)"),
    (l3_checks.check_plan_step, plan_ignores_max_num_seqs, "max_num_seqs stops admission"),
    (l3_checks.check_plan_step, plan_jumps_the_queue, "no chunking: nobody jumps the queue"),
    (l3_checks.check_preempt, preempt_oldest, "three decoding, equal priority: the newest goes"),
    (
        l3_checks.check_preempt,
        preempt_newest_id,
        "priorities: the lowest priority goes, though it is the oldest",
    ),
    (
        l3_checks.check_preempt,
        preempt_appends_to_waiting,
        "an older request goes back in front of newer waiting ones",
    ),
    (l3_checks.check_preempt, preempt_keeps_computed, "the worked example: two running, free list [5]"),
    (l3_checks.check_preempt, preempt_drops_output, "generated tokens are kept: all 14 are recomputed"),
    (
        l3_checks.check_preempt,
        preempt_frees_reversed,
        "its blocks join the back of the free list, in block-table order",
    ),
    (l3_checks.check_preempt, preempt_bypasses_allocator, "three decoding, equal priority: the newest goes"),
    (l4_checks.check_merge, merge_without_rescale, "4 rows, 5 + 7 keys, D 8"),
    (l4_checks.check_merge, merge_exp_of_max, "large scores (maxima 157 to 234): exp must not overflow"),
    (
        l4_checks.check_attend_blocks,
        attend_without_acc_rescale,
        "large scores (maxima 52 to 71): the running max must be used",
    ),
    (
        l4_checks.check_attend_blocks,
        attend_positions_without_block_index,
        "decode, block_size 7: 23 keys, the last block partly stale",
    ),
    (l4_checks.check_attend_blocks, attend_unmasked, "a whole 16-token prompt in one block (causal)"),
    (
        l4_checks.check_kv_splits,
        splits_floor,
        "7 blocks, 3 splits: ceil(7 / 3) = 3 blocks each, the last gets 1",
    ),
    (
        l4_checks.check_kv_splits,
        splits_unmasked_last_block,
        "10 blocks, 2 splits: 5 + 5 blocks, the last holds 1 key",
    ),
    (l4_checks.check_kv_splits, splits_balanced, "5 full blocks, 4 splits: only 3 splits (2 + 2 + 1)"),
    (
        l4_checks.check_kv_splits,
        splits_first_block_zero,
        "table [7, 2, 9, 4, 0], 18 keys, block_size 4, 2 splits",
    ),
    (
        l4_checks.check_kv_splits,
        splits_logical_ids,
        "a table longer than the history: its tail is never read",
    ),
]


# The exercise each checker grades: (stage package, exercise id), for its hidden cases.
EXERCISE_OF = {
    l3_checks.check_slots: ("L3_block_tensor", "L3.1"),
    l3_checks.check_plan_step: ("L3_block_tensor", "L3.2"),
    l3_checks.check_preempt: ("L3_block_tensor", "L3.3"),
    l3_checks.check_admitted: ("L3_block_tensor", "L3.4"),
    l4_checks.check_merge: ("L4_paged_kernel", "L4.1"),
    l4_checks.check_attend_blocks: ("L4_paged_kernel", "L4.2"),
    l4_checks.check_kv_splits: ("L4_paged_kernel", "L4.3"),
}


@pytest.mark.parametrize(("checker", "wrong", "case_name"), WRONG, ids=[w.__name__ for _, w, _ in WRONG])
def test_wrong_answer_fails(capsys, checker, wrong, case_name):
    lines, passed, total = graded(capsys, checker, wrong)
    assert passed < total, "\n".join(lines)
    assert lines[-1] != f"{total}/{total} passed"
    caught = [
        line
        for line in lines[:-1]
        if f" ({case_name}): " in line and re.search(r"\): (WRONG — |raised )", line)
    ]
    assert caught, f"case {case_name!r} did not catch {wrong.__name__}:\n" + "\n".join(lines)
    assert_fails_hidden(*EXERCISE_OF[checker], wrong)


REFERENCES = [
    # (checker, the reference notebook, the function its solution cell defines)
    (l3_checks.check_slots, "L3_block_tensor.ipynb", "slots"),
    (l3_checks.check_plan_step, "L3_block_tensor.ipynb", "plan_step"),
    (l3_checks.check_preempt, "L3_block_tensor.ipynb", "preempt"),
    (l3_checks.check_admitted, "L3_block_tensor.ipynb", "admitted"),
    (l4_checks.check_merge, "L4_paged_kernel.ipynb", "merge"),
    (l4_checks.check_attend_blocks, "L4_paged_kernel.ipynb", "attend_blocks"),
    (l4_checks.check_kv_splits, "L4_paged_kernel.ipynb", "kv_splits"),
]


@pytest.mark.parametrize(("checker", "notebook", "name"), REFERENCES, ids=[n for _, _, n in REFERENCES])
def test_reference_notebook_solution_passes(capsys, checker, notebook, name):
    lines, passed, total = graded(capsys, checker, reference_solution(notebook, name))
    assert passed == total > 0, "\n".join(lines)
    assert lines[-1] == f"{total}/{total} passed"
    assert not any("WRONG" in line or "raised" in line for line in lines)


INDEPENDENT = [
    (l3_checks.check_slots, l3_answers.slots),
    (l3_checks.check_plan_step, l3_answers.plan_step),
    (l3_checks.check_preempt, l3_answers.preempt),
    (l3_checks.check_admitted, l3_answers.admitted),
    (l4_checks.check_merge, l4_answers.merge),
    (l4_checks.check_attend_blocks, l4_answers.attend_blocks),
    (l4_checks.check_kv_splits, l4_answers.kv_splits),
]


@pytest.mark.parametrize(("checker", "answer"), INDEPENDENT, ids=[c.__name__ for c, _ in INDEPENDENT])
def test_the_independent_answer_passes(capsys, checker, answer):
    """The checker compares with the stage's code, the answer is written apart from it: a stage that
    went wrong would fail the answer here."""
    lines, passed, total = graded(capsys, checker, answer)
    assert passed == total > 0, "\n".join(lines)
    assert lines[-1] == f"{total}/{total} passed"


def test_the_checkers_references_give_the_worked_examples():
    """What the checkers take from the stage's code, on the examples their docstrings and the
    notebook work out by hand."""
    assert slots([7, 2], 2, 6, 4) == [30, 31, 8, 9]
    # L3.4: five (3, 5) on 16 blocks of 4, max_model_len 32: on_demand 1 block each; Oracle 8 positions,
    # 2 blocks, a run of 2; Pow2 3 + 8 = 11 positions, 3 blocks, a run of 4; Max 32 positions, a run of 8
    policies = ("on_demand", "oracle", "pow2", "max")
    admits = {p: l3_checks.scheduler_admitted(p, [(3, 5)] * 5, 16, 4, 32) for p in policies}
    assert admits == {"on_demand": 5, "oracle": 5, "pow2": 4, "max": 2}
    assert l3_checks.scheduler_admitted("oracle", [(2, 8)] * 6, 16, 4, 32) == 4  # 10 positions: a run of 4
    assert l3_checks.scheduler_admitted("max", [(3, 5)] * 3, 24, 4, 48) == 1  # 12 blocks: a run of 16
    assert l4_checks._kernel_splits([7, 2, 9, 4, 0], 18, 4, 2) == [(0, [7, 2, 9], 12), (3, [4, 0], 6)]
    assert l4_checks._kernel_splits([3, 1], 20, 16, 4) == [(0, [3], 16), (1, [1], 4)]
    m = torch.tensor([0.0, float(torch.log(torch.tensor(3.0)))])  # one key per side, scores 0 and ln 3
    out = merge_partials(m[:, None], torch.ones(2, 1), torch.tensor([[[1.0]], [[5.0]]]))
    assert torch.allclose(out, torch.tensor([[4.0]]))
    # all-zero keys: every visible key weighs the same, so each query gets the mean of its values
    k_pool, v_pool = torch.zeros(3, 2, 1), torch.arange(6.0).reshape(3, 2, 1)  # values 0..5
    m, l, acc = attend_blocks(
        torch.ones(1, 1, 2, 1), k_pool[:, :, None], v_pool[:, :, None], [2, 0], torch.tensor([0, 2]), 1.0
    )  # blocks [2, 0]: positions 0..3 hold values 4, 5, 0, 1
    assert (acc[0, 0] / l[0, 0][:, None]).flatten().tolist() == [4.0, 3.0]  # 4; (4 + 5 + 0) / 3


def test_the_preempt_checker_gives_the_notebook_worked_example():
    """The notebook's worked example, block_size 4: request 1 (blocks [1, 3, 4]) is preempted; its
    blocks join the free list [5] at the back; it waits in front of request 2, with its 2 tokens."""
    allocator, running, waiting = l3_checks._preempt_state(
        4, 6, [(0, 6, 2, 7, 0), (1, 8, 2, 9, 0)], [(2, 5, 0, 0)], 0
    )
    assert [s.block_table for s in running] == [[0, 2], [1, 3, 4]] and list(allocator.free_blocks) == [5]
    victim = l3_answers.scheduler_preempt(running, waiting, allocator)
    assert victim.request_id == 1 and [s.request_id for s in running] == [0]
    assert list(allocator.free_blocks) == [5, 1, 3, 4] and [s.request_id for s in waiting] == [1, 2]
    assert victim.block_table == [] and victim.num_computed_tokens == 0 and victim.status is Status.WAITING
    assert len(victim.all_ids) == 10


def attend_without_max(q, k_pool, v_pool, blocks, q_pos, scale):
    """Sums exp(s) with no running max at all: right until a score passes 88, where float32's exp
    overflows (inf / inf = NaN). The notebook's largest scores are 71, so its cases pass it."""
    block_size = k_pool.shape[1]
    l, acc = torch.zeros(q.shape[0]), torch.zeros(q.shape)
    for j, block in enumerate(blocks):
        s = (q @ k_pool[block].T) * scale  # (Tq, block_size)
        k_pos = j * block_size + torch.arange(block_size)
        p = torch.exp(s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf")))
        l, acc = l + p.sum(dim=-1), acc + p @ v_pool[block]
    return acc / l[:, None]


def test_the_hidden_cases_catch_what_the_shown_ones_cannot(capsys):
    """A loop without the running max passes the eight cases the notebook shows and fails the hidden
    ones, whose scores go past exp's range."""
    lines, passed, total = graded(capsys, l4_checks.check_attend_blocks, attend_without_max)
    assert passed == total, "\n".join(lines)
    assert_fails_hidden("L4_paged_kernel", "L4.2", attend_without_max)


def test_a_stub_fails_every_case(capsys):
    """What an untouched exercise notebook hands the checker: every case raises NotImplementedError."""

    def stub(*args):
        raise NotImplementedError("Exercise L3.3: preempt a running request")

    lines, passed, total = graded(capsys, l3_checks.check_preempt, stub)
    assert passed == 0 and total > 0
    assert all("raised NotImplementedError: Exercise L3.3" in line for line in lines[:-1])
