"""The benchmark's report: ratios to HF and to the ceilings, the targets, the Markdown table, the plots,
and the verdict on the outputs (``verdict``: a stage that differs from HF batch 1 fails the run, a
peer that does is reported).

A run's targets depend on its device (``results["device"]``, absent in runs before it was recorded:
the CPU): issue #13's on a CPU, issue #27's on a GPU, each met, missed or not separable in this run,
decided on the spread of the run's timed runs (``decide``), not on the medians alone.
"""

from __future__ import annotations

from pathlib import Path

from kvcourse.harness.compare import TIE_GAP

PEERS = {"vs_hf_batched": "HF batched", "vs_generate_batch": "HF generate_batch"}


def workload_ceiling(results: dict, work: str) -> float | None:
    """tokens/s that (b) or (u) allows with its prompts' prefill counted (None in runs before it was
    measured)."""
    return results.get("workload_ceilings", {}).get(work, {}).get("ceiling_tok_s")


def add_ratios(results: dict) -> None:
    """tokens/s as multiples of HF and as fractions of the ceilings, for (a), (b) and (u)."""
    ceil = results["ceilings"]
    systems = results["systems"]
    for row in systems.values():
        if "a" in row:
            row["a"]["vs_hf_batch1"] = row["a"]["tok_s"] / systems["HF batch 1"]["a"]["tok_s"]
            row["a"]["of_batch1_ceiling"] = row["a"]["tok_s"] / ceil["batch1_ceiling_tok_s"]
        for work in ("b", "u"):
            if work in row:
                for key, peer in PEERS.items():
                    if work in systems.get(peer, {}):
                        row[work][key] = row[work]["tok_s"] / systems[peer][work]["tok_s"]
                row[work]["of_large_batch_ceiling"] = row[work]["tok_s"] / ceil["large_batch_ceiling_tok_s"]
                if workload_ceiling(results, work):
                    row[work]["of_workload_ceiling"] = row[work]["tok_s"] / workload_ceiling(results, work)


def on_gpu(results: dict) -> bool:
    """Whether a run's systems ran on a CUDA GPU (``"device": "cuda:0 (NVIDIA H100 80GB HBM3)"``)."""
    return results.get("device", "cpu").startswith("cuda")


def result_name(results: dict) -> str:
    """The name a run's JSON and plots take, so that a GPU run never overwrites the CPU's: ``bench`` for
    a CPU run of its whole plan, ``bench-cuda`` for a GPU's, and a part (``--workloads``) adds its
    letters: ``bench-cuda-b``, ``bench-cuda-ua``."""
    name = "bench-cuda" if on_gpu(results) else "bench"
    part = any(why.startswith("not asked for") for why in results.get("skipped", {}).values())
    return name + ("-" + "".join(results["workloads"]) if part else "")


def speeds(results: dict) -> dict[tuple[str, str], float]:
    """tokens/s per (system, workload) of (a), (b), (u) and (c), e.g. ``{("L4", "b"): 134.1, ...}``."""
    return {
        (name, work): row[work]["tok_s"]
        for name, row in results["systems"].items()
        for work in ("a", "b", "u", "c")
        if work in row
    }


def run_rates(row: dict) -> list[float]:
    """tokens/s of each timed run of one system on one workload (its new tokens over the run's
    seconds); a row without ``runs`` is its one median: ``run_rates({"tok_s": 10.0, "seconds": 2.0,
    "runs": [2.0, 4.0]})`` -> ``[10.0, 5.0]``."""
    tokens = row.get("new_tokens") or row["tok_s"] * row["seconds"]
    return [tokens / seconds for seconds in row.get("runs") or [row["seconds"]]]


def spread(row: dict) -> str:
    """The slowest and the fastest run's tokens/s, ``"125.6-127.7"``, or "" for a system timed once."""
    rates = run_rates(row)
    return f"{min(rates):.1f}-{max(rates):.1f}" if len(rates) > 1 else ""


def decide(lowest: float, highest: float, at_least: float) -> bool | None:
    """A target "x >= at_least" where the run's spread puts x between ``lowest`` and ``highest``: met
    (True) when even the lowest reaches it, missed (False) when even the highest does not, and None,
    not separable in this run, when the spread straddles it."""
    return True if lowest >= at_least else False if highest < at_least else None


VERDICTS = {True: "met", False: "missed", None: "not separable in this run"}


def fastest(tok: dict, names: list[str], work: str) -> str | None:
    """The system among ``names`` with the most tokens/s on ``work`` (None if none ran it)."""
    return max((n for n in names if (n, work) in tok), key=lambda n: tok[n, work], default=None)


def ratio_target(results: dict, tok: dict, target: str, a, b, work: str, at_least: float,
                 against_ceiling: bool = False) -> list[dict]:  # fmt: skip
    """``[{"target", "measured", "met"}]`` for "a >= at_least x b on work", or [] where either did not run
    it. ``against_ceiling`` adds what the ratio would ask of the workload's compute ceiling.

    The ratio is of the medians; ``met`` is decided on the runs' spread (``decide``): every pairing of
    a's runs with b's, from a's slowest over b's fastest to a's fastest over b's slowest. Where a
    system ran more than once, ``measured`` quotes each one's slowest and fastest run."""
    if (a, work) not in tok or (b, work) not in tok:
        return []
    ratio = tok[a, work] / tok[b, work]
    row_a, row_b = results["systems"][a][work], results["systems"][b][work]
    rates_a, rates_b = run_rates(row_a), run_rates(row_b)
    runs = (
        f"; runs {spread(row_a) or 'one'} vs {spread(row_b) or 'one'}"
        if spread(row_a) or spread(row_b)
        else ""
    )
    measured = f"{a} {ratio:.2f}x {b} ({tok[a, work]:.1f} vs {tok[b, work]:.1f} tok/s{runs})"
    ceiling = workload_ceiling(results, work)
    if ceiling and against_ceiling:  # what the target asks of the machine
        measured += (
            f"; {at_least:g}x {b} would be {at_least * tok[b, work] / ceiling:.0%} of ({work})'s compute "
            f"ceiling ({ceiling:.0f} tok/s), {b} is at {tok[b, work] / ceiling:.0%}"
        )
    met = decide(min(rates_a) / max(rates_b), max(rates_a) / min(rates_b), at_least)
    return [{"target": target, "measured": measured, "met": met}]


def targets(results: dict) -> list[dict]:
    """The targets for the run's device, each measured in this run: what, the number, met or not. On a
    CPU issue #13's; on a GPU issue #27's items 3 and 4 (``gpu_targets``)."""
    if on_gpu(results):
        return gpu_targets(results)
    systems, ceil, tok = results["systems"], results["ceilings"], speeds(results)
    stages = [n for n in systems if n.startswith("L")]
    torch_stages = [n for n in stages if n != "L6"]
    out = []
    for target, a, b, work in (
        ("L4 >= L3 on (b)", "L4", "L3", "b"),
        ("L5 >= L4 on (b)", "L5", "L4", "b"),
        ("L5 > L4 on (c), sharing shows in time", "L5", "L4", "c"),
        ("L6 >= L3 on (b)", "L6", "L3", "b"),
    ):
        out += ratio_target(results, tok, target, a, b, work, 1.0)
    if ("L6", "a") in tok:
        share = tok["L6", "a"] / ceil["batch1_ceiling_tok_s"]
        runs = f"; runs {spread(systems['L6']['a'])}" if spread(systems["L6"]["a"]) else ""
        measured = f"{share:.0%} ({tok['L6', 'a']:.1f} of {ceil['batch1_ceiling_tok_s']:.1f} tok/s{runs})"
        rates = run_rates(systems["L6"]["a"])
        if "f" in results:  # a token that were nothing but its products, against the same ceiling
            products = 1 / results["f"][-1]["XLA"]["seconds"] / ceil["batch1_ceiling_tok_s"]
            measured += f"; XLA's matrix-vector products alone ((f)) would allow {products:.0%}"
        lowest, highest = (r / ceil["batch1_ceiling_tok_s"] for r in (min(rates), max(rates)))
        out.append({"target": "L6 (a) >= 85% of the batch-1 ceiling", "measured": measured,
                    "met": decide(lowest, highest, 0.85)})  # fmt: skip
    for target, among, peer, work, at_least, against_ceiling in (
        ("best torch stage >= 2.5x HF batched on (b)", torch_stages, "HF batched", "b", 2.5, True),
        ("best stage >= 2x HF generate_batch on (b)", stages, "HF generate_batch", "b", 2.0, False),
        ("best stage >= 2x HF generate_batch on (u)", stages, "HF generate_batch", "u", 2.0, False),
        ("best stage >= 1.6x HF batched on (u)", stages, "HF batched", "u", 1.6, True),
    ):
        best = fastest(tok, among, work)
        out += ratio_target(results, tok, target, best, peer, work, at_least, against_ceiling)
    return out


GPU_TOK_S = 5000  # issue #27: the best stage's tokens/s on (b), on an H100-class GPU
L6_FIRST_RUN_S = 15  # issue #27: L6's first generate() of (b), compiling included


def gpu_targets(results: dict) -> list[dict]:
    """Issue #27's targets on a GPU: L4 >= 1.5x L3 on (b); the best torch stage >= 2x HF generate_batch
    on (b) and on (u); the best stage >= 5,000 tok/s on (b); L6's first run of (b) <= 15 s.

    L6's first run is its untimed warm-up on (b): its seconds include tracing and compiling every program
    (b) needs; (b) is the first workload of a GPU run (``bench.run.PLANS``), so nothing JAX compiled
    before helps it. Example: L4 at 3,000 tok/s and L3 at 1,500 on (b) -> "L4 2.00x L3 (...)", met."""
    systems, tok = results["systems"], speeds(results)
    stages = [n for n in systems if n.startswith("L")]
    torch_stages = [n for n in stages if n != "L6"]
    peer = "HF generate_batch"
    out = ratio_target(results, tok, "L4 >= 1.5x L3 on (b)", "L4", "L3", "b", 1.5)
    for work in ("b", "u"):
        target = f"best torch stage >= 2x {peer} on ({work})"
        out += ratio_target(results, tok, target, fastest(tok, torch_stages, work), peer, work, 2.0)
    best = fastest(tok, stages, "b")
    if best:
        gpu = results.get("machine", {}).get("gpu", {}).get("name", results["device"])
        rates = run_rates(systems[best]["b"])
        out.append({
            "target": f"best stage >= {GPU_TOK_S:,} tok/s on (b) (on an H100-class GPU)",
            "measured": f"{best} {tok[best, 'b']:,.0f} tok/s on {gpu}",
            "met": decide(min(rates), max(rates), GPU_TOK_S),
        })  # fmt: skip
    l6 = systems.get("L6", {}).get("b")
    if l6:
        measured = (
            f"{l6['warmup_seconds']:.1f} s (its untimed first run, tracing and compiling included; "
            f"its timed runs {l6['seconds']:.1f} s)"
        )
        compiles = l6.get("compiles")
        if compiles:
            measured += f"; compiles after it {compiles['after_warmup']}, after the timed runs {compiles['after_runs']}"
            same = compiles["after_warmup"] == compiles["after_runs"]
            measured += ": the timed runs compiled nothing new" if same else ": the timed runs compiled again"
        out.append({"target": f"L6 first run of (b) <= {L6_FIRST_RUN_S} s", "measured": measured,
                    "met": l6["warmup_seconds"] <= L6_FIRST_RUN_S})  # fmt: skip
    return out


def _cell(row: dict, work: str, fmt: str, key: str, scale: float = 1.0) -> str:
    value = row.get(work, {}).get(key)
    return "-" if value is None else format(scale * value, fmt)


def _speed(row: dict, work: str) -> str:
    """A speed cell: the median tokens/s, and the slowest and fastest run where there were several:
    ``127.2 (125.6-127.7)``."""
    if "tok_s" not in row.get(work, {}):
        return "-"
    runs = spread(row[work])
    return f"{row[work]['tok_s']:.1f}" + (f" ({runs})" if runs else "")


def _agreement(row: dict) -> str:
    """Token agreement with HF batch 1 over every timed workload: matches, ties, mismatches."""
    parts = [row[w]["agreement"] for w in ("a", "b", "u", "c") if "agreement" in row.get(w, {})]
    if not parts:
        return "reference"
    match = sum(p["match"] for p in parts)
    ties = sum(len(p["ties"]) for p in parts)
    wrong = sum(len(p["mismatches"]) for p in parts)
    return f"{match + ties}/{match + ties + wrong}" + (f" ({ties} ties)" if ties else "")


def disagreements(results: dict) -> list[dict]:
    """Every request whose output differed from HF batch 1's beyond the tie rule, from the ``agreement``
    of each system's timed workloads, one dict each. ``peer``: whether the system is one of ``PEERS``
    (a comparison, not the course's code) rather than a stage or a stage's fast path. A request is
    listed only where the tie rule did not excuse it (``tie_rule_applied`` is False), and
    ``hf_top2_gap`` says why: HF's top-2 logit gap at that token, at least ``TIE_GAP``, or None where
    one of the two generated no token there. Example, HF batched's request 29 of (b) in issue 46's GPU
    run (the gap made up: that run did not record it)::

        {"system": "HF batched", "peer": True, "workload": "b", "request": 29, "token": 102,
         "tie_rule_applied": False, "hf_top2_gap": 0.83}
    """
    found = []
    for name, row in results["systems"].items():
        for work in ("a", "b", "u", "c"):
            agree = row.get(work, {}).get("agreement", {})
            for request, status in agree.get("mismatches", {}).items():  # status: "DIFF@<token>"
                found.append({"system": name, "peer": name in PEERS.values(), "workload": work,
                              "request": int(request), "token": int(status.partition("@")[2]),
                              "tie_rule_applied": False, "hf_top2_gap": agree["hf_gaps"][request]})  # fmt: skip
    return found


def describe_disagreement(d: dict) -> str:
    """One line of ``verdict``'s, e.g. "HF batched (b): request 29 differs from HF batch 1 at token 102;
    HF's top-2 logit gap there is 0.83, not below the tie rule's 0.001: not a tie"."""
    if d["hf_top2_gap"] is None:
        why = "one of them generated no token there, which is never a tie"
    else:
        why = f"HF's top-2 logit gap there is {d['hf_top2_gap']:.2g}, not below the tie rule's {TIE_GAP:g}: not a tie"
    return f"{d['system']} ({d['workload']}): request {d['request']} differs from HF batch 1 at token {d['token']}; {why}"


def verdict(found: list[dict]) -> tuple[int, str]:
    """The bench's exit status and what it prints of ``disagreements``: 1 where one of the course's
    systems (a stage, or a stage's fast path) differed from HF batch 1 ("bench FAILED"), else 0. A
    peer's disagreement is printed and fails nothing: the peers are what the course is compared
    with, not its code."""
    peers = [describe_disagreement(d) for d in found if d["peer"]]
    course = [describe_disagreement(d) for d in found if not d["peer"]]
    lines = []
    if peers:
        lines += ["peers differ from HF batch 1 (reported, not a failure: a peer is not the course's code):"]
        lines += [f"  {line}" for line in peers]
    if course:
        lines += ["bench FAILED: outputs differ from HF batch 1 beyond the tie rule:"]
        lines += [f"  {line}" for line in course]
    return (1 if course else 0), "\n".join(lines)


def first_runs_table(results: dict) -> list[str]:
    """Each system's untimed first run next to its median timed run, seconds: what compiling costs.

    Example row: ``| L6 | 10.7 / 2.1 | 25.6 / 14.1 | ...``: L6's first run of each workload traces and
    compiles its jit'd calls, a torch stage's first run is about as fast as the others. A system timed
    once on a workload warms up on its first request only: ``1.3 (1 request) / 95.8``.
    """
    works = [w for w in ("a", "b", "u", "c") if any(w in row for row in results["systems"].values())]

    def cell(row: dict, work: str) -> str:
        if "warmup_seconds" not in row.get(work, {}):
            return "-"
        w = row[work]
        # warmup_requests is in the JSON since 2026-11-25; before, a single timed run marked such a system
        if "warmup_requests" in w:
            part = w["warmup_requests"] < w["requests"]
        else:
            part = len(w["runs"]) < results["sizes"]["repeats"]
        first = f"{w['warmup_seconds']:.1f}" + (" (1 request)" if part else "")
        return f"{first} / {w['seconds']:.1f}"

    lines = [
        "| first (untimed) run / median timed run, s | " + " | ".join(f"({w})" for w in works) + " |",
        "|---|" + "---|" * len(works),
    ]
    for name, row in results["systems"].items():
        lines.append(f"| {name} | " + " | ".join(cell(row, w) for w in works) + " |")
    return lines


def gpu_line(gpu: dict) -> str:
    """The GPU's line, e.g. ``NVIDIA H100 80GB HBM3, 79.2 GiB, compute 9.0, CUDA 13.0, driver 580.1``."""
    return (
        f"{gpu['name']}, {gpu['memory_GiB']:.1f} GiB, compute {gpu['compute_capability']}, "
        f"CUDA {gpu['cuda_runtime']}, driver {gpu['driver'] or 'unknown (no nvidia-smi)'}"
    )


def compiles_lines(results: dict) -> list[str]:
    """One line per engine that compiles (L6): its traces per jit'd function after its untimed first run
    and after its timed runs, per workload, e.g. ``L6 compiles, after the first run / after the timed
    runs: (b) {'prefill': 2, 'decode': 6} / {'prefill': 2, 'decode': 6}``."""
    lines = []
    for name, row in results["systems"].items():
        cells = [
            f"({w}) {row[w]['compiles']['after_warmup']} / {row[w]['compiles']['after_runs']}"
            for w in ("a", "b", "u", "c")
            if row.get(w, {}).get("compiles", {}).get("after_warmup")
        ]
        if cells:
            lines.append(f"{name} compiles, after the first run / after the timed runs: " + "; ".join(cells))
    return [""] + lines if lines else []


def summary_table(results: dict) -> str:
    """The Markdown tables ``bench/README.md`` shows: speeds, then the targets. The first lines name the
    device every system ran on, the machine, and the workloads a run skipped, with why."""
    c, m, sizes = results["ceilings"], results["machine"], results["sizes"]
    lines = [
        f"device: {results.get('device', 'cpu')}" + (f", {gpu_line(m['gpu'])}" if "gpu" in m else ""),
        f"machine: {m['processor']}, {m['threads']} threads, {m['platform']}, torch {m['torch']}"
        + "".join(f", {k} {m[k]}" for k in ("triton", "jax", "jaxlib") if m.get(k)),
        *[f"skipped ({w}): {why}" for w, why in results.get("skipped", {}).items()],
        f"ceilings{' (of the GPU)' if on_gpu(results) else ''}: copy {c['copy_bandwidth_GBps']:.1f} GB/s over {c['weight_bytes'] / 1e6:.0f} MB of weights -> "
        f"batch-1 {c['batch1_ceiling_tok_s']:.1f} tok/s; matmul {c['matmul_GFLOPs']:.1f} GFLOP/s -> "
        f"large-batch {c['large_batch_ceiling_tok_s']:.1f} tok/s"
        + "".join(
            f"; ({w}) with its prompts {v['ceiling_tok_s']:.1f} tok/s ({v['GFLOP']:.0f} GFLOP)"
            for w, v in results.get("workload_ceilings", {}).items()
        ),
        "C++ kernels, build time (once per CPU, by make setup): "
        + (
            ", ".join(f"{k} {v:.0f} s" for k, v in results.get("cpp_kernel_build_seconds", {}).items() if v)
            or "-"
        )
        if not on_gpu(results)
        else 'L4 and L5: kernel="auto", their Triton kernel (the kernel column of the JSON\'s (b) rows says)',
        *[
            f"NOT BUILT: {problem} (its stage ran the PyTorch kernel)"
            for problem in results.get("cpp_kernel_problems", {}).values()
        ],  # fmt: skip
        f"every time: median of {sizes['repeats']} runs after an untimed warm-up, the systems' runs interleaved "
        "(one run for one-at-a-time systems on (b) and (u)), in brackets the slowest and the fastest run's tok/s; "
        "agreement: outputs equal to HF batch 1's, tie rule applied",
        "",
        f"| system | (a) batch-1 tok/s | of b1 ceiling | (b) {sizes['b_requests']} mixed tok/s | vs HF batched "
        f"| vs generate_batch | (u) {sizes['u_requests']} uniform tok/s | vs HF batched | vs generate_batch "
        f"| (b) KV utilization | (c) n={sizes['c_n']} tok/s | (c) blocks held / private copies | tokens = HF b1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in results["systems"].items():
        c_kv = row.get("c_kv")
        blocks = f"{c_kv['blocks_held']} / {c_kv['private_copies_blocks']}" if c_kv else "-"
        lines.append(
            f"| {name} | {_speed(row, 'a')} | {_cell(row, 'a', '.0%', 'of_batch1_ceiling')} "
            f"| {_speed(row, 'b')} | {_cell(row, 'b', '.2f', 'vs_hf_batched')}x "
            f"| {_cell(row, 'b', '.2f', 'vs_generate_batch')}x | {_speed(row, 'u')} "
            f"| {_cell(row, 'u', '.2f', 'vs_hf_batched')}x | {_cell(row, 'u', '.2f', 'vs_generate_batch')}x "
            f"| {_cell(row, 'b_kv', '.1%', 'utilization')} | {_speed(row, 'c')} "
            f"| {blocks} | {_agreement(row)} |"
        )
    lines = [line.replace("| -x ", "| - ") for line in lines]
    lines += ["", *first_runs_table(results), *compiles_lines(results)]
    if results.get("targets"):
        lines += ["", "| target | measured | |", "|---|---|---|"]
        lines += [
            f"| {t['target']} | {t['measured']} | {VERDICTS[t['met']]} |"
            for t in targets(results)  # decided again from the runs, by today's rule
        ]
    if "e" in results:
        e = results["e"]
        lines += ["", "| (e) L6 attention alone | ms per call |", "|---|---|"]
        lines += [f"| {name} | {ms:.2f} |" for name, ms in e["block_sizes_ms"].items()]
        r = e["reset_ms"]
        lines += [
            "",
            f"(e) reset of a {r['pool_MiB']:.1f} MiB pool: logical {r['logical']:.2f} ms, physical {r['physical']:.1f} ms",
        ]
    if "f" in results:
        from bench import matvec  # imports torch and JAX: only when there is an (f) to print

        lines += ["", "(f) one batch-1 token's matrix-vector products alone:", ""]
        lines.append(matvec.table(results["f"], results["ceilings"]["copy_bandwidth_GBps"]))
    return "\n".join(lines)


def plot(results: dict, folder: Path) -> None:
    """Draw throughput.png and, where (d) ran, decode_latency.png into ``folder`` (made if missing); a GPU
    run's or a part's names end like its JSON's (``result_name``): ``throughput-cuda.png``."""
    suffix = result_name(results).removeprefix("bench")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    systems, ceil = results["systems"], results["ceilings"]
    decode_only = ceil["large_batch_ceiling_tok_s"]  # for runs before workload ceilings were measured
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, work, ceiling, title in (
        (axes[0], "a", ceil["batch1_ceiling_tok_s"], "(a) batch-1 decode"),
        (axes[1], "b", workload_ceiling(results, "b") or decode_only, "(b) 32 mixed requests"),
        (axes[2], "u", workload_ceiling(results, "u") or decode_only, "(u) 32 uniform requests"),
    ):
        names = [n for n in systems if work in systems[n]]
        ax.bar(names, [systems[n][work]["tok_s"] for n in names], color="tab:blue")
        ax.axhline(ceiling, color="tab:red", linestyle="--", label=f"ceiling {ceiling:.0f} tok/s")
        ax.set_title(title)
        ax.set_ylabel("output tokens/s")
        plt.setp(ax.get_xticklabels(), rotation=40, ha="right")
        ax.legend()
    fig.tight_layout()
    fig.savefig(folder / f"throughput{suffix}.png", dpi=110)
    plt.close(fig)

    if not any("d" in row for row in systems.values()):  # a GPU run, or (d) not asked for
        return
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name, row in systems.items():
        if "d" in row:
            contexts = [int(c) for c in row["d"]]
            ax.plot(contexts, [1000 * s for s in row["d"].values()], "o-", label=name)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode step (ms)")
    ax.set_title("(d) decode latency vs context, batch 1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / f"decode_latency{suffix}.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    """``python -m bench.report [RESULTS.json]``: the tables and plots again from a saved run (the
    measurements are not touched; ratios and targets are recomputed from them)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m bench.report", description=main.__doc__.splitlines()[0])
    here = Path(__file__).resolve().parent
    parser.add_argument("results", nargs="?", default=str(here / "results" / "bench.json"))
    parser.add_argument("--plots", default=str(here / "plots"), help="folder for the plots")
    args = parser.parse_args(argv)
    path = Path(args.results)
    results = json.loads(path.read_text())
    add_ratios(results)
    results["targets"] = targets(results)
    path.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, Path(args.plots))
    print(summary_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
