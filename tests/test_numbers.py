"""Every measured table in the chapters and READMEs says where its numbers come from, and the generated
ones match the results files they come from (``kvcourse.tools.numbers``, ``make numbers``)."""

from __future__ import annotations

import re

import pytest

from kvcourse.tools import numbers
from kvcourse.tools.numbers import DOCS, ROOT, SOURCES


def test_generated_tables_match_their_results_files(capsys):
    """A results file changed without ``make numbers`` (or a table edited by hand) fails here."""
    assert numbers.main(["--check"]) == 0, capsys.readouterr().out


@pytest.mark.parametrize("doc", DOCS)
def test_every_table_of_numbers_says_where_they_come_from(doc):
    problems = numbers.unmarked_tables((ROOT / doc).read_text(encoding="utf-8"))
    assert not problems, (
        f"{doc}: tables of numbers with no numbers block or marker above them:\n" + "\n".join(problems)
    )


@pytest.mark.parametrize("doc", DOCS)
def test_every_named_command_exists(doc):
    problems = [
        p
        for c in numbers.commands((ROOT / doc).read_text(encoding="utf-8"))
        if (p := numbers.command_problem(c))
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("key", SOURCES)
def test_every_source_command_is_run_by_a_test_on_a_tiny_model(key):
    """The command behind a generated table runs in the suite (its ``--quick`` mode), so it cannot rot."""
    path, name = SOURCES[key].tested_by.split("::")
    assert re.search(rf"^def {name}\(", (ROOT / path).read_text(encoding="utf-8"), re.MULTILINE), SOURCES[key]


def test_unmarked_table_of_numbers_is_found_and_a_marker_clears_it():
    table = "| run | ms |\n|---|---|\n| a | 1.5 |"
    assert numbers.unmarked_tables(f"text\n{table}\n") == ["line 2: | run | ms |"]
    assert numbers.unmarked_tables(f"<!-- measured: make bench -->\n{table}\n") == []
    assert numbers.unmarked_tables(f"<!-- arithmetic -->\n{table}\n") == []
    assert numbers.unmarked_tables("| field | meaning |\n|---|---|\n| a | the first |\n") == []


def test_a_command_that_names_nothing_is_caught():
    assert numbers.command_problem("python -m bench.decode_cost") is None
    assert numbers.command_problem(".venv/bin/python L3_block_tensor/l3_smoke.py") is None
    assert numbers.command_problem("OMP_WAIT_POLICY=PASSIVE python -m bench.decode_cost --out x") is None
    assert "no module bench.nothing" in numbers.command_problem("python -m bench.nothing")
    assert "no file L3_block_tensor/scratch.py" in numbers.command_problem(
        "python L3_block_tensor/scratch.py"
    )
    assert "no target 'numbrs'" in numbers.command_problem("make numbrs")


def test_a_stale_block_is_rewritten_from_its_results(tmp_path):
    """Between the markers the tool writes the provenance line and the table; an unknown key is an error."""
    key = "l1-decode-cost"
    text = f"intro\n<!-- numbers: {key} (written by make numbers; do not edit) -->\n| old |\n{numbers.END}\nafter\n"
    new = numbers.rewrite(text, "doc.md")
    assert new.splitlines()[2].startswith(
        "*`python -m bench.decode_cost` -> `bench/results/decode-cost-cpu.json`"
    )
    assert "| old |" not in new and new.endswith(f"{numbers.END}\nafter\n")
    with pytest.raises(SystemExit, match="unknown numbers block 'nope'"):
        numbers.rewrite(
            "<!-- numbers: nope (written by make numbers; do not edit) -->\n" + numbers.END, "doc.md"
        )
