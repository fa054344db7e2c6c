"""Token-by-token comparison of an engine's output with a reference, and the per-prompt report.

The bar is exact equality. The one tolerance (the same idea as ``check_logprobs_close`` in vLLM's
``tests/models/utils.py``, 2025): if at the first differing position the HF reference's top-2 logit
gap is below ``TIE_GAP``, the two runs disagree on a numerical tie (fp32 engines that batch
differently differ from HF in the last bits of each logit; ``tests/test_model_parts.py`` holds a full
forward of the course model within 1e-4 of HF's logits). That is reported as a tie, with its position and gap,
and nothing after it is compared: the two continuations are from then on different texts. A tie is
never counted silently as a match.

HF's gaps describe HF's own text. So the rule applies only where the expected tokens still are HF's
text: always when comparing with HF; when comparing with the previous stage, only if that stage
agreed with HF up to the differing position. Once the previous stage has tied away from HF, its
continuation is another text whose gaps nobody measured, and any later difference is a mismatch.

Beam search (``compare_beams``) is compared step by step: the beams the engine extended at each step
against HF's (as sets of token lists, recorded by ``hf_beams``). Where they first part, the choice
made the step before differed; if there HF's smallest gap between neighbouring ranked candidate scores
was below ``TIE_GAP``, that is a numerical tie at that step, reported, and nothing after it is
compared. A difference in the returned hypotheses with the same beams at every step (a finished
hypothesis kept or not, a search that stops at another step) is a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcourse.harness.reference import BeamReference, Reference

TIE_GAP = 1e-3


@dataclass(frozen=True)
class Comparison:
    first_diff: int | None  # first position where the tokens differ (None: identical)
    tie_gap: float | None = None  # HF's top-2 gap at first_diff when that gap is below TIE_GAP

    @property
    def ok(self) -> bool:
        return self.first_diff is None or self.tie_gap is not None

    @property
    def status(self) -> str:
        """``match``, ``tie@17`` or ``DIFF@17``."""
        if self.first_diff is None:
            return "match"
        return f"tie@{self.first_diff}" if self.tie_gap is not None else f"DIFF@{self.first_diff}"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ, counting a length difference.

    Examples: ``([1, 2, 3], [1, 2, 3]) -> None``, ``([1, 2, 3], [1, 5, 3]) -> 1``,
    ``([1, 2], [1, 2, 3]) -> 2``.
    """
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # a length difference is checked below
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(expected: list[int], got: list[int], hf: Reference) -> Comparison:
    """Compare ``got`` with ``expected``, applying the tie rule with HF's per-position top-2 gaps.

    ``expected`` is HF's tokens (possibly cut to a cap) or the previous stage's. The tie rule needs
    both runs to have picked a token at the first difference (a missing token is never a tie) and
    ``expected`` to be HF's text up to there. Example, HF [5, 9, 4] with gaps [2.0, 1e-4, 3.0]:
    ``compare([5, 9, 4], [5, 7, 1], hf)`` is ``tie@1``; ``compare([5, 9, 4], [5, 9], hf)`` is
    ``DIFF@2``; a previous stage [5, 8, 4] against [5, 8, 6] is ``DIFF@2`` (at 2 its text is not HF's).
    """
    pos = first_difference(expected, got)
    if pos is None:
        return Comparison(None)
    picked_both = pos < min(len(expected), len(got))
    hf_text = expected[:pos] == hf.tokens[:pos]
    if picked_both and hf_text and pos < len(hf.gaps) and hf.gaps[pos] < TIE_GAP:
        return Comparison(pos, hf.gaps[pos])
    return Comparison(pos)


def beam_history(steps: list[list[tuple[int, int]]]) -> list[list[list[int]]]:
    """The new tokens of the beams extended at each step, from each step's survivors (parent, token).

    Example: ``[[(0, 5), (0, 7)], [(1, 2), (0, 4)]]`` (two steps of width 2) ->
    ``[[[]], [[5], [7]]]``: step 0 extended the prompt alone, step 1 the beams [5] and [7]; the last
    step's survivors [7, 2] and [5, 4] were never extended.
    """
    beams = [[[]]]
    for survivors in steps[:-1]:
        beams.append([[*beams[-1][parent], token] for parent, token in survivors])
    return beams


def compare_beams(got: list[list[int]], steps: list[list[tuple[int, int]]], hf: BeamReference) -> Comparison:
    """Compare an engine's beam search (its hypotheses and its survivors per step) with HF's.

    ``first_diff`` is a step here. Example, HF's beams [[[]], [[5], [7]], ...] with gaps [0.3, 2e-4, ...]
    and an engine whose step 1 extended [[5], [9]]: the choice at step 0 differed, HF's gap there is
    0.3: ``DIFF@0``; had it extended those at step 2 instead, ``tie@1``.
    """
    if got == hf.sequences:
        return Comparison(None)
    mine = beam_history(steps)
    for s in range(min(len(mine), len(hf.beams))):
        if sorted(mine[s]) != sorted(hf.beams[s]):
            step = max(s - 1, 0)
            return Comparison(step, hf.gaps[step] if s and hf.gaps[step] < TIE_GAP else None)
    return Comparison(min(len(mine), len(hf.beams)))


def _one_line(text: str, width: int = 70) -> str:
    flat = text.replace("\n", "\\n")
    return flat if len(flat) <= width else flat[: width - 3] + "..."


@dataclass
class Row:
    """One prompt's verdict: the stage against HF, and (when there is one) against the previous stage."""

    label: str
    vs_hf: Comparison
    vs_prev: Comparison | None
    text: str  # decoded output of the stage under test
    hf_text: str  # decoded HF output, shown when they differ
    unit: str = "position"  # what a Comparison's first_diff counts: a token position, or a beam search "step"

    @property
    def ok(self) -> bool:
        return self.vs_hf.ok and (self.vs_prev is None or self.vs_prev.ok)

    @property
    def tie(self) -> bool:
        """True when the row agrees only up to a reported numerical tie."""
        return self.ok and any(c is not None and c.tie_gap is not None for c in (self.vs_hf, self.vs_prev))


def format_rows(rows: list[Row], prev_name: str | None) -> str:
    """The per-prompt table: number, verdicts, then the decoded text (and HF's where they differ)."""
    head = f"{'#':>3}  {'vs HF':<9}" + (f"{'vs ' + prev_name:<9}" if prev_name else "") + "output"
    lines = [head]
    for i, r in enumerate(rows, start=1):
        cells = f"{i:>3}  {r.vs_hf.status:<9}" + (f"{r.vs_prev.status:<9}" if r.vs_prev else "")
        lines.append(cells + _one_line(r.text))
        for c, who in ((r.vs_hf, "HF"), (r.vs_prev, prev_name)):
            if c is not None and c.tie_gap is not None:
                lines.append(
                    f"{'':14}numerical tie vs {who} at {r.unit} {c.first_diff}: "
                    f"HF top-2 gap {c.tie_gap:.1e} < {TIE_GAP:g}; compared no further"
                )
        if r.vs_hf.first_diff is not None:
            lines.append(f"{'':14}HF: {_one_line(r.hf_text)}")
    return "\n".join(lines)
