"""The measured tables of the chapters and READMEs, written from the committed results that hold them:
``python -m kvcourse.tools.numbers [--check]`` (``make numbers``).

A table made from a results file sits between two marker lines::

    <!-- numbers: l1-decode-cost (written by make numbers; do not edit) -->
    *`python -m bench.decode_cost` -> `bench/results/decode-cost-cpu.json`: commit 7c78912, AMD EPYC 7B13 ...*

    | position `t` | ... |
    <!-- numbers: end -->

and this tool writes everything between them: a line naming the command, its results file, the commit
it was measured at, the machine and the date (as the file records them), then the table, drawn by the
same function that printed it when the command ran (``SOURCES`` below). A chapter's prose around the
block says what the numbers mean; the numbers themselves are never typed by hand.

Every other table of numbers in ``DOCS`` (the chapters, ``lessons/setup.md``, ``README.md``, ...) carries a
comment on the line above it saying where its numbers come from:

    <!-- measured: COMMAND -->   measured by COMMAND (or several, between semicolons), kept by hand;
                                 the prose around it names the commit and the machine
    <!-- arithmetic -->         computed from sizes, not measured
    <!-- quoted: SOURCE -->     measured elsewhere, by SOURCE

``tests/test_numbers.py`` checks all of it: every block current (``--check``), every table of numbers
marked, every command named one that exists, and every ``SOURCES`` command run by a test on a tiny model.

Left out on purpose: numbers inside sentences. A sentence that gives a figure names its command in
the same paragraph; no tool reads prose.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("lessons/L1_contiguous.md", "lessons/L2_token_flat.md", "lessons/L3_block_tensor.md",
        "lessons/L4_paged_kernel.md", "lessons/L5_clones.md", "lessons/L6_tpu_jax.md",
        "lessons/setup.md", "lessons/exercises.md", "README.md", "bench/README.md")  # fmt: skip
BEGIN = re.compile(r"^<!-- numbers: (?P<key>[\w-]+) \(written by make numbers; do not edit\) -->$")
END = "<!-- numbers: end -->"
MARK = re.compile(r"^<!-- (measured: (?P<command>.+?)|arithmetic|quoted: .+?) -->$")
# a table holds measured-looking numbers when a body cell has a decimal point or a unit after a digit
NUMBER = re.compile(r"\d\.\d|\d\s*(ms|s|µs|us|tok/s|GB/s|GFLOP/s|MiB|GiB|KiB|MB|GB|%|x)\b")


@dataclass(frozen=True)
class Source:
    """Where a generated table comes from: the committed ``command`` that measured it, the ``results``
    file it wrote (relative to the repository), ``render`` ("module:function", results dict -> Markdown)
    and which table of that Markdown (``table``, counting from 0), and ``tested_by``, the test that runs
    the command on a tiny model ("tests/file.py::test_name")."""

    command: str
    results: str
    render: str
    tested_by: str
    table: int = 0


SOURCES = {
    "l1-decode-cost": Source(
        "python -m bench.decode_cost",
        "bench/results/decode-cost-cpu.json",
        "bench.decode_cost:table",
        "tests/test_bench.py::test_quick_decode_cost_reads_kv_by_position_and_times_each_step",
    ),
    "l4-reference-kernel": Source(
        "python -m bench.reference_kernel",
        "bench/results/reference-kernel-cpu.json",
        "bench.reference_kernel:table",
        "tests/test_bench.py::test_quick_reference_kernel_table_checks_every_way_against_l3",
    ),
    "kernels-interpreter": Source(
        "python -m bench.kernels --interpreter",
        "bench/results/kernels-interpreter.json",
        "bench.kernels:interpreter_table",
        "tests/test_bench.py::test_quick_interpreter_table_runs_each_step_on_its_prompts",
    ),
    "kernels-decode": Source(
        "python -m bench.kernels --device cpu",
        "bench/results/kernels.json",
        "bench.kernels:table",
        "tests/test_bench.py::test_quick_kernel_table_checks_and_times_every_kernel",
    ),
    "gpu-check-cuda": Source(
        "python -m kvcourse.tools.gpu_check --side-by-side",
        "bench/results/gpu-check-cuda.json",
        "kvcourse.tools.gpu_check:table",
        "tests/test_devices.py::test_the_gpu_check_runs_its_steps_side_by_side_and_records_them",
    ),
    "kernels-decode-cuda": Source(
        "python -m bench.kernels --device cuda",
        "bench/results/kernels-cuda.json",
        "bench.kernels:table",
        "tests/test_bench.py::test_quick_kernel_table_checks_and_times_every_kernel",
    ),
    "kernel-resources": Source(
        "python -m bench.kernels --resources --out bench/results/kernel-resources.json",
        "bench/results/kernel-resources.json",
        "bench.kernels:resources_results_table",
        "tests/test_bench.py::test_kernel_resources_read_the_jits_build",
    ),
    "kernel-resources-prefill": Source(
        "python -m bench.kernels --resources --prefill --out bench/results/kernel-resources-prefill.json",
        "bench/results/kernel-resources-prefill.json",
        "bench.kernels:resources_results_table",
        "tests/test_bench.py::test_kernel_resources_read_the_jits_build",
    ),
    "decode-ops-before": Source(
        "python -m bench.profile --device cpu --stages L4:cpp --torch-profiler "
        "--out bench/results/decode-ops-before.json",
        "bench/results/decode-ops-before.json",
        "bench.profile:kernel_results_table",
        "tests/test_bench.py::test_quick_profile_under_torch_profiler_on_the_cpu",
    ),
    "decode-ops": Source(
        "python -m bench.profile --device cpu --stages L4:cpp --torch-profiler --out bench/results/decode-ops.json",
        "bench/results/decode-ops.json",
        "bench.profile:kernel_results_table",
        "tests/test_bench.py::test_quick_profile_under_torch_profiler_on_the_cpu",
    ),
    "kernels-prefill-cuda": Source(
        "python -m bench.kernels --device cuda --prefill",
        "bench/results/kernels-prefill-cuda.json",
        "bench.kernels:prefill_table",
        "tests/test_bench.py::test_quick_prefill_table_times_query_tiles_against_the_kernel_before_them",
    ),
    "simulated-rates": Source(
        "python -m bench.simulate",
        "bench/results/simulated.json",
        "bench.simulate:headline",
        "tests/test_simulate.py::test_quick_experiment_runs_every_policy_dataset_and_profile",
    ),
    "simulated-breakdown": Source(
        "python -m bench.simulate",
        "bench/results/simulated.json",
        "bench.simulate:headline",
        "tests/test_simulate.py::test_quick_experiment_runs_every_policy_dataset_and_profile",
        table=1,
    ),
    "serving-policies": Source(
        "python -m bench.serving",
        "bench/results/serving.json",
        "bench.serving:table",
        "tests/test_serving.py::test_bench_serving_runs_every_system_and_checks_every_output",
    ),
    "serving-peers": Source(
        "python -m bench.serving",
        "bench/results/serving.json",
        "bench.serving:table",
        "tests/test_serving.py::test_bench_serving_runs_every_system_and_checks_every_output",
        table=1,
    ),
    "serving-chunked": Source(
        "python -m bench.serving",
        "bench/results/serving.json",
        "bench.serving:table",
        "tests/test_serving.py::test_bench_serving_runs_every_system_and_checks_every_output",
        table=2,
    ),
    "serving-repeats": Source(
        "python -m bench.serving --plan repeats",
        "bench/results/serving_repeats.json",
        "bench.serving:repeats_table",
        "tests/test_serving.py::test_the_repeats_plan_calibrates_then_serves_each_stream_again",
    ),
    "serving-repeats-checks": Source(
        "python -m bench.serving --plan repeats",
        "bench/results/serving_repeats.json",
        "bench.serving:repeats_table",
        "tests/test_serving.py::test_the_repeats_plan_calibrates_then_serves_each_stream_again",
        table=1,
    ),
    "bench-speeds-cuda": Source(
        "python -m bench.run --device cuda --workloads b --stages L4,L5 --peers none",
        "bench/results/bench-cuda-b.json",
        "bench.report:summary_table",
        "tests/test_bench.py::test_quick_bench_writes_results_and_plots",
        table=0,
    ),
    "bench-targets-cuda": Source(
        "python -m bench.run --device cuda --workloads b --stages L4,L5 --peers none",
        "bench/results/bench-cuda-b.json",
        "bench.report:summary_table",
        "tests/test_bench.py::test_quick_bench_writes_results_and_plots",
        table=2,
    ),
    "bench-speeds": Source(
        "make bench",
        "bench/results/bench.json",
        "bench.report:summary_table",
        "tests/test_bench.py::test_quick_bench_writes_results_and_plots",
        table=0,
    ),
    "bench-first-runs": Source(
        "make bench",
        "bench/results/bench.json",
        "bench.report:summary_table",
        "tests/test_bench.py::test_quick_bench_writes_results_and_plots",
        table=1,
    ),
    "bench-targets": Source(
        "make bench",
        "bench/results/bench.json",
        "bench.report:summary_table",
        "tests/test_bench.py::test_quick_bench_writes_results_and_plots",
        table=2,
    ),
    "bench-e": Source(
        "make bench",
        "bench/results/bench.json",
        "bench.report:summary_table",
        "tests/test_bench.py::test_quick_bench_writes_results_and_plots",
        table=3,
    ),
    "bench-f": Source(
        "make bench",
        "bench/results/bench.json",
        "bench.report:summary_table",
        "tests/test_bench.py::test_quick_bench_writes_results_and_plots",
        table=4,
    ),
    "l6-compile": Source(
        "python -m bench.l6_compile --device cpu",
        "bench/results/l6-compile-cpu.json",
        "bench.l6_compile:table",
        "tests/test_l6_scan.py::test_quick_l6_compile_measures_unrolled_and_scanned_in_fresh_processes",
    ),
    "l5-sharing-samples": Source(
        "python -m bench.sharing",
        "bench/results/sharing.json",
        "bench.sharing:table",
        "tests/test_bench.py::test_quick_sharing_counts_what_each_way_of_sharing_saves",
        table=0,
    ),
    "l5-sharing-prefix": Source(
        "python -m bench.sharing",
        "bench/results/sharing.json",
        "bench.sharing:table",
        "tests/test_bench.py::test_quick_sharing_counts_what_each_way_of_sharing_saves",
        table=1,
    ),
    "l5-sharing-greedy": Source(
        "python -m bench.sharing",
        "bench/results/sharing.json",
        "bench.sharing:table",
        "tests/test_bench.py::test_quick_sharing_counts_what_each_way_of_sharing_saves",
        table=2,
    ),
    "l5-beam-memory": Source(
        "python -m bench.beam_memory",
        "bench/results/beam-memory.json",
        "bench.beam_memory:table",
        "tests/test_l5_beams.py::test_quick_beam_memory_saves_blocks_and_copying_changes_no_token",
        table=0,
    ),
    "l5-beam-throughput": Source(
        "python -m bench.beam_memory",
        "bench/results/beam-memory.json",
        "bench.beam_memory:table",
        "tests/test_l5_beams.py::test_quick_beam_memory_saves_blocks_and_copying_changes_no_token",
        table=1,
    ),
}


def tables(markdown: str) -> list[list[str]]:
    """The Markdown tables in ``markdown``, each as its lines: ``tables("a\\n| x |\\n|---|\\n| 1 |\\n")``
    -> ``[["| x |", "|---|", "| 1 |"]]``."""
    found, current = [], []
    for line in markdown.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            found.append(current)
            current = []
    return found


def provenance(source: Source, results: dict) -> str:
    """The line above a generated table: command, file, commit, machine, date, as the results file
    records them (every one records a clean commit and a date: ``tests/test_results_provenance.py``),
    not from the git history, which a shallow clone or a student release does not have."""
    commit = results.get("commit")
    where = f"measured at commit {commit}" if commit else "commit not recorded"
    machine = results.get("machine") or results.get("device_name") or "machine not recorded"
    if isinstance(machine, dict) and "processor" in machine:  # make bench's: processor, threads, torch (GPU)
        host = f"{machine['processor']}, {machine['threads']} threads, torch {machine['torch']}"
        machine = f"{machine['gpu']['name']} (host {host})" if machine.get("gpu") else host
    elif isinstance(machine, dict):  # bench.serving's and bench.simulate's: cpu, cores (and torch)
        machine = f"{machine['cpu']}, {machine['cores']} cores" + (f", torch {machine['torch']}" if "torch" in machine else "")
    when = results.get("when") or results.get("date")
    line = f"*`{source.command}` -> `{source.results}`: {where}; {machine}" + (f"; {when}" if when else "")
    if "rescored" in results:  # bench.serving --rescore: columns computed afterwards from the recorded runs
        line += f"; rescored at commit {results['rescored']['commit']} by `{results['rescored']['command']}`"
    return line + "*"


def render(key: str) -> list[str]:
    """The lines a block ``key`` holds, from its results file as committed."""
    source = SOURCES[key]
    results = json.loads((ROOT / source.results).read_text(encoding="utf-8"))
    module, function = source.render.split(":")
    markdown = getattr(importlib.import_module(module), function)(results)
    found = tables(markdown)
    if source.table >= len(found):
        raise SystemExit(f"{key}: {source.render} drew {len(found)} table(s), no table {source.table}")
    return [provenance(source, results), "", *found[source.table]]


def rewrite(text: str, path: str) -> str:
    """``text`` with every numbers block written again; an unknown key or a missing end is an error."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        out.append(lines[i])
        match = BEGIN.match(lines[i])
        i += 1
        if not match:
            continue
        key = match["key"]
        if key not in SOURCES:
            raise SystemExit(f"{path}:{i}: unknown numbers block '{key}' (known: {', '.join(SOURCES)})")
        end = next((j for j in range(i, len(lines)) if lines[j] == END), None)
        if end is None:
            raise SystemExit(f"{path}:{i}: numbers block '{key}' has no '{END}' line")
        out += render(key)
        i = end
    return "\n".join(out) + "\n"


def unmarked_tables(text: str) -> list[str]:
    """The first lines of tables of numbers in ``text`` that sit in no numbers block and have no marker
    comment on the line above: ``"| ms |\\n|---|\\n| 1.5 |"`` -> ``["line 1: | ms |"]``."""
    lines, problems, inside = text.splitlines(), [], False
    for i, line in enumerate(lines):
        inside = (inside or bool(BEGIN.match(line))) and line != END
        starts = line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))
        if not starts or inside:
            continue
        table = []
        for j in range(i, len(lines)):
            if not lines[j].startswith("|"):
                break
            table.append(lines[j])
        body = "\n".join(table[2:])
        if NUMBER.search(body) and not (i > 0 and MARK.match(lines[i - 1])):
            problems.append(f"line {i + 1}: {line[:80]}")
    return problems


def commands(text: str) -> list[str]:
    """The commands named in ``text``'s measured markers and numbers blocks:
    ``commands("<!-- measured: make test; make smoke -->")`` -> ``["make test", "make smoke"]``."""
    named = [
        c.strip()
        for line in text.splitlines()
        if (m := MARK.match(line)) and m["command"]
        for c in m["command"].split(";")
    ]
    named += [SOURCES[m["key"]].command for line in text.splitlines() if (m := BEGIN.match(line))]
    return named


def command_problem(command: str) -> str | None:
    """Why ``command`` names nothing in the repository, or None: ``python -m MODULE`` needs the module,
    ``python PATH`` the file, ``make TARGET`` the Makefile target. Environment assignments and
    ``.venv/bin/`` are allowed in front."""
    words = [w for w in shlex.split(command) if "=" not in w.split("/")[0]]
    if not words:
        return f"'{command}': no command"
    program = words[0].removeprefix(".venv/bin/")
    if program == "make":
        target = words[1] if len(words) > 1 else ""
        if not re.search(rf"^{re.escape(target)}:", (ROOT / "Makefile").read_text(), re.MULTILINE):
            return f"'{command}': the Makefile has no target '{target}'"
    elif program == "python" and len(words) > 2 and words[1] == "-m":
        if importlib.util.find_spec(words[2]) is None:
            return f"'{command}': no module {words[2]}"
    elif program == "python" and len(words) > 1:
        if not (ROOT / words[1]).is_file():
            return f"'{command}': no file {words[1]}"
    else:
        return f"'{command}': not a python or make command"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvcourse.tools.numbers", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a block is out of date"
    )
    args = parser.parse_args(argv)
    stale = []
    for name in DOCS:
        path = ROOT / name
        text = path.read_text(encoding="utf-8")
        new = rewrite(text, name)
        if new != text:
            stale.append(name)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    verb = "out of date" if args.check else "written"
    print(f"numbers: {len(stale)} file(s) {verb}" + (f": {', '.join(stale)}" if stale else ""))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
