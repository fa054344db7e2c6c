"""The benchmark code runs end to end on tiny sizes, so ``make bench`` cannot rot between runs.

Nothing here checks a speed: timing asserts would only measure how busy the machine is. The CPU tests
ask for ``--device cpu`` (the default, ``auto``, would pick a GPU where there is one); the ``cuda`` ones
run the GPU plan in a subprocess, without ``make test``'s ``JAX_PLATFORMS=cpu``, so that L6 gets JAX's GPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cpp_kernel import PROBLEM

from bench import ceilings, kernels, matvec, measure, profile, report, run, workloads
from kvcourse.harness.reference import Reference
from kvcourse.model_store import REPO_ROOT

NO_GPU = "no CUDA device (torch.cuda.is_available() is False)"


@pytest.mark.slow
def test_quick_bench_writes_results_and_plots(tmp_path, capsys):
    assert run.main(["--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results" / "bench.json").read_text())
    systems, sizes = results["systems"], results["sizes"]
    assert results["device"] == results["ceilings"]["device"] == "cpu" and results["skipped"] == {}
    assert results["workloads"] == list(run.PLANS["cpu"]) and "gpu" not in results["machine"]
    assert all(options["device"] == "cpu" for options in results["stage_options"].values())
    # L6 traced its programs in its first run of each workload, and its timed runs traced nothing new
    for work in ("a", "b", "u", "c"):
        compiles = systems["L6"][work]["compiles"]
        assert compiles["after_warmup"] and compiles["after_runs"] == compiles["after_warmup"], work
    assert systems["L3"]["b"]["compiles"] == {"after_warmup": {}, "after_runs": {}}  # torch compiles nothing
    assert "compiles" not in systems["HF batched"]["b"]
    assert systems["L4"]["b_kv"]["kernel"] == ("cpp" if PROBLEM is None else "torch")
    max_new_tokens = workloads.mixed_workload(49152, sizes["b_requests"], sizes["b_prompt"], sizes["b_new"])[
        1
    ]
    assert {"HF batch 1", "HF batched", "HF generate_batch", "L1"} <= set(systems)
    for name, row in systems.items():
        assert {"b", "c"} <= set(row), name
        assert row["b"]["tok_s"] > 0 and row["b"]["new_tokens"] == sum(max_new_tokens)
        assert len(row["b"]["runs"]) in (1, sizes["repeats"]) and row["b"]["warmup_seconds"] > 0
        one_at_a_time = name in ("HF batch 1", "L1", "L2")  # warmed up on the first request only
        assert row["b"]["warmup_requests"] == (1 if one_at_a_time else len(max_new_tokens)), name
        if name != "HF batch 1":  # every other system's outputs equal HF batch 1's (tie rule)
            assert not row["b"]["agreement"]["mismatches"], name
            assert row["b"]["agreement"]["match"] + len(row["b"]["agreement"]["ties"]) == len(
                max_new_tokens
            ), name
        if name.startswith("L"):
            assert 0 < row["b_kv"]["utilization"] <= 1, name
            assert set(row["d"]) == {str(c) for c in sizes["d_contexts"]}
        if "c_kv" in row:  # prefilled once and cloned: fewer blocks than private copies
            assert 0 < row["c_kv"]["blocks_held"] < row["c_kv"]["private_copies_blocks"], name
    assert results["stage_options"]["L4"].get("kernel") == ("cpp" if PROBLEM is None else None)
    assert bool(results["cpp_kernel_problems"]) == (PROBLEM is not None)
    assert (
        systems["HF batched"]["b"]["computed_new_tokens"]
        == len(max_new_tokens) * max(max_new_tokens)
        > sum(max_new_tokens)
    )
    assert results["disagreements"] == []  # every system, peers included, agrees with HF batch 1
    assert {t["target"] for t in results["targets"]} >= {
        "L4 >= L3 on (b)",
        "best stage >= 1.6x HF batched on (u)",
    }
    for key in ("copy_bandwidth_GBps", "matmul_GFLOPs", "batch1_ceiling_tok_s", "large_batch_ceiling_tok_s"):
        assert results["ceilings"][key] > 0
    assert [row["weight"] for row in results["f"]] == [*matvec.LAYER_WEIGHTS, "lm_head", "whole token"]
    assert all(row[lib]["seconds"] > 0 for row in results["f"] for lib in ("torch", "XLA"))
    assert (tmp_path / "plots" / "throughput.png").stat().st_size > 0
    assert (tmp_path / "plots" / "decode_latency.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "| L1 |" in out and "| HF generate_batch |" in out and "| target | measured |" in out
    assert "| L6 | " in out.split("| first (untimed) run / median timed run, s |")[1]
    assert (
        out.startswith("device: cpu\n")
        and "L6 compiles, after the first run / after the timed runs: (a)" in out
    )
    assert "| whole token |" in out and "XLA's matrix-vector products alone ((f)) would allow" in out
    # the tables again from the saved file, measurements untouched; the plots into a folder not made yet
    again_plots = tmp_path / "plots again"
    assert report.main([str(tmp_path / "results" / "bench.json"), "--plots", str(again_plots)]) == 0
    assert (again_plots / "throughput.png").stat().st_size > 0
    again = capsys.readouterr().out.strip()
    assert again and again in out


def test_a_part_of_the_plan_is_named_by_its_workloads(tmp_path, capsys):
    """--workloads b: (b) alone, everything else of the CPU's plan skipped as not asked for, written to
    bench-b.json and throughput-b.png (the whole plan's bench.json untouched); no (d), no latency plot."""
    args = ["--quick", "--device", "cpu", "--workloads", "b", "--stages", "L3", "--peers", "none"]
    assert run.main([*args, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results" / "bench-b.json").read_text())
    assert results["workloads"] == ["b"] and set(results["skipped"]) == set(run.PLANS["cpu"]) - {"b"}
    assert {name: set(row) for name, row in results["systems"].items()} == {
        "HF batch 1": {"b"},
        "L3": {"b", "b_kv"},
    }
    assert not (tmp_path / "results" / "bench.json").exists() and "e" not in results and "f" not in results
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["throughput-b.png"]
    assert "skipped (a): not asked for (--workloads)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        run.main(["--quick", "--device", "cpu", "--workloads", "b,x"])
    assert "--workloads: choose from a,b,u,c,d,e,f on cpu, got b,x" in capsys.readouterr().err


def test_timed_runs_are_interleaved_across_systems():
    calls = []

    def job(name, repeats):
        return measure.Job(
            lambda: calls.append(name) or [[len(calls)]], repeats, lambda: calls.append(f"warm {name}")
        )

    rows = measure.timed_together({"A": job("A", 3), "B": job("B", 1), "C": job("C", 3)})
    assert calls == ["warm A", "warm B", "warm C", "A", "B", "C", "A", "C", "A", "C"]
    assert [len(rows[n][0]["runs"]) for n in "ABC"] == [3, 1, 3]
    assert rows["A"][1] == [[9]] and rows["B"][1] == [[5]]  # each system's last run's outputs


def test_workload_ceiling_counts_prompt_rows_and_head_rows():
    layer = SimpleNamespace(a=torch.ones(3), b=torch.ones(5), bias=None)  # 8 parameters
    weights = SimpleNamespace(layers=[layer, layer], lm_head=torch.ones(10))
    # a 3-token prompt and 2 new tokens: 4 rows through 16 layer parameters, 2 rows through a head of 10
    got = ceilings.workload_ceiling(weights, [[5, 6, 7]], [2], flops=168.0)
    assert got["GFLOP"] == pytest.approx(2 * (4 * 16 + 2 * 10) / 1e9)
    assert got["ceiling_tok_s"] == pytest.approx(2.0)


def test_mixed_workload_is_seeded_and_in_range():
    prompts, max_new_tokens = workloads.mixed_workload(100, 5, (10, 20), (3, 4), seed=1)
    assert (prompts, max_new_tokens) == workloads.mixed_workload(100, 5, (10, 20), (3, 4), seed=1)
    assert all(10 <= len(p) <= 20 and all(3 <= t < 100 for t in p) for p in prompts)
    assert all(3 <= b <= 4 for b in max_new_tokens)


def test_quick_profile_splits_a_step_into_its_parts(tmp_path, capsys):
    """The printed tables hold every part; ``--out`` writes them with their command and commit, a stage
    named twice is profiled twice."""
    l4 = "L4:cpp" if PROBLEM is None else "L4:torch"  # the C++ kernel where this machine could build it
    out_file = tmp_path / "profile.json"
    argv = ["--quick", "--device", "cpu", "--stages", f"L3,{l4},L6,L3", "--out", str(out_file)]
    assert profile.main(argv) == 0
    out = capsys.readouterr().out
    for part in (*profile.PARTS, "prefill", "decode", "host_state", "host Python"):
        assert f"| {part} |" in out
    assert f"{l4} ms/decode step" in out and "decode steps on the device" in out
    assert re.search(r"L6: first run [\d.]+ s \(tracing and compiling included\)", out), out
    assert "torch.profiler" not in out  # only on a GPU or when asked for
    results = json.loads(out_file.read_text())
    assert results["command"] == "python -m bench.profile " + " ".join(argv) and results["commit"]
    assert list(results["profiles"]) == ["L3", l4, "L3 #2"]
    assert all(p["decode_step_ms"]["gather + loop"] > 0 for k, p in results["profiles"].items() if "L3" in k)
    assert results["l6"]["compiles"]["after_first_run"]
    compile_s = results["l6"]["first_run_compile_s"]  # JAX's compile events cover part of the first run
    assert set(compile_s) == {"trace", "lower", "XLA compile"} and compile_s["XLA compile"] > 0
    assert sum(compile_s.values()) <= results["l6"]["first_run_s"]
    assert re.search(r"JAX's compile events cover trace [\d.]+ s, lower [\d.]+ s, XLA compile [\d.]+ s", out)


def test_covered_seconds_counts_overlapping_spans_once():
    assert profile.covered_seconds([(0, 2), (1, 3), (5, 6)]) == 4
    assert profile.covered_seconds([(0, 5), (1, 2)]) == 5 and profile.covered_seconds([]) == 0


def test_quick_profile_under_torch_profiler_on_the_cpu(capsys):
    """--torch-profiler on a CPU: the decode steps it picks (first, middle, last of the run's decode-only
    steps, counted by the host-timer table), each with its wall time, 'n/a' for device busy time and its
    share, and the ops it ran; then the ops with the most self CPU time."""
    assert profile.main(["--quick", "--device", "cpu", "--stages", "L3,L4:torch", "--torch-profiler"]) == 0
    out = capsys.readouterr().out
    counts = re.findall(r"\| (\d+) steps \| (\d+) decode", out)  # the host-timer table's, per stage
    for spec, (steps, decode) in zip(("L3", "L4:torch"), counts, strict=True):
        row = rf"^\| {re.escape(spec)} \| (\d+) \| (\d+) \| ([\d.]+) \| n/a \| n/a \| (\d+) \|$"
        rows = re.findall(row, out, re.M)
        assert len(rows) == min(int(decode), profile.PROFILED_STEPS), out
        assert int(rows[-1][0]) == int(steps) - 1  # (b)'s last step decodes the last request's last token
        assert all(int(r) >= 1 and float(ms) > 0 and int(ops) > 0 for _, r, ms, ops in rows)
        assert len(re.findall(rf"^\| {re.escape(spec)} \| `aten::", out, re.M)) == profile.TOP_KERNELS
    assert "ops by self CPU time" in out


def test_spread_picks_first_last_and_between():
    assert profile.spread([4, 5, 6, 7, 8], 3) == [4, 6, 8]
    assert (
        profile.spread([4, 9], 3) == [4, 9] and profile.spread([4], 3) == [4] and profile.spread([], 3) == []
    )


def test_cuda_without_a_gpu_is_one_error_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert measure.bench_device("auto") == torch.device("cpu")
    for main in (run.main, profile.main):
        assert main(["--quick", "--device", "cuda"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"error: --device cuda: {NO_GPU}"]


def gpu_run(cmd: list[str], tmp_path) -> subprocess.CompletedProcess:
    """``python -m <cmd>`` from the repository root, JAX free to use its GPU backend."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    return subprocess.run(
        [sys.executable, "-m", *cmd], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900
    )


@pytest.mark.cuda
def test_quick_bench_on_a_gpu_runs_the_gpu_plan(tmp_path):
    done = gpu_run(["bench.run", "--quick", "--device", "cuda", "--out", str(tmp_path)], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "results" / "bench-cuda.json").read_text())
    systems = results["systems"]
    assert (tmp_path / "plots" / "throughput-cuda.png").exists()
    assert results["device"].startswith("cuda") and results["ceilings"]["device"].startswith("cuda")
    assert results["workloads"] == ["b", "u", "a"] and set(results["skipped"]) == {"c", "d", "e", "f"}
    assert (
        results["machine"]["gpu"]["name"] in results["device"] and "e" not in results and "f" not in results
    )
    for name in ("L4", "L5"):
        assert (
            results["stage_options"][name]["kernel"] == "auto" and systems[name]["b_kv"]["kernel"] == "triton"
        )
    assert systems["L6"]["b_kv"]["device"].startswith("gpu")
    assert systems["L6"]["b"]["compiles"]["after_runs"] == systems["L6"]["b"]["compiles"]["after_warmup"]
    for name, row in systems.items():
        assert "c" not in row and "d" not in row, name
        for work in ("a", "b", "u"):
            if name != "HF batch 1" and work in row:
                assert not row[work]["agreement"]["mismatches"], (name, work)
    assert {t["target"] for t in results["targets"]} == {
        "L4 >= 1.5x L3 on (b)",
        "best torch stage >= 2x HF generate_batch on (b)",
        "best torch stage >= 2x HF generate_batch on (u)",
        "best stage >= 5,000 tok/s on (b) (on an H100-class GPU)",
        "L6 first run of (b) <= 15 s",
    }
    assert done.stdout.startswith("device: cuda")


@pytest.mark.cuda
def test_quick_profile_on_a_gpu_counts_kernels(tmp_path):
    done = gpu_run(["bench.profile", "--quick", "--device", "cuda"], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = re.findall(
        r"^\| (L[345]) \| \d+ \| \d+ \| ([\d.]+) \| ([\d.]+) \| \d+% \| (\d+) \|$", done.stdout, re.M
    )
    assert {r[0] for r in rows} == {"L3", "L4", "L5"}, done.stdout
    assert all(float(busy) > 0 and int(launches) > 0 for _, _, busy, launches in rows)
    assert "L6: first run" in done.stdout


def test_gpu_targets_from_a_gpu_run():
    """Issue #27's targets from a GPU run's numbers (made up here): each met or missed by its ratio."""

    def row(tok_s, **more):
        return {"tok_s": tok_s, "seconds": 1.0, **more}

    l6_b = row(
        6000.0, warmup_seconds=12.0, compiles={"after_warmup": {"decode": 6}, "after_runs": {"decode": 6}}
    )
    results = {
        "device": "cuda:0 (NVIDIA H100 80GB HBM3)",
        "machine": {"gpu": {"name": "NVIDIA H100 80GB HBM3"}},
        "ceilings": {},
        "systems": {
            "HF generate_batch": {"b": row(400.0), "u": row(650.0)},
            "L3": {"b": row(1000.0), "u": row(1000.0)},
            "L4": {"b": row(1400.0), "u": row(1400.0)},
            "L5": {"b": row(1500.0), "u": row(1200.0)},
            "L6": {"b": l6_b, "u": row(2000.0, warmup_seconds=30.0)},
        },
    }
    got = {t["target"]: (t["met"], t["measured"]) for t in report.targets(results)}
    assert got["L4 >= 1.5x L3 on (b)"] == (False, "L4 1.40x L3 (1400.0 vs 1000.0 tok/s)")
    assert got["best torch stage >= 2x HF generate_batch on (b)"][0] is True  # L5: 3.75x
    assert got["best torch stage >= 2x HF generate_batch on (b)"][1].startswith("L5 3.75x")
    assert got["best torch stage >= 2x HF generate_batch on (u)"][1].startswith("L4 2.15x")  # not L6's 3.08x
    assert got["best stage >= 5,000 tok/s on (b) (on an H100-class GPU)"] == (
        True, "L6 6,000 tok/s on NVIDIA H100 80GB HBM3",
    )  # fmt: skip
    met, measured = got["L6 first run of (b) <= 15 s"]
    assert met and measured.startswith("12.0 s") and "compiled nothing new" in measured
    l6_b["warmup_seconds"] = 80.0
    assert not {t["target"]: t["met"] for t in report.targets(results)}["L6 first run of (b) <= 15 s"]
    del results["device"]  # a run from before the device was recorded: the CPU's targets
    assert "L4 >= L3 on (b)" in {t["target"] for t in report.targets(results)}


def test_a_ratio_target_is_decided_on_the_spread_of_the_runs():
    """Medians 1.05x apart decide nothing by themselves: met only when L4's slowest run beats L3's
    fastest, missed only when L4's fastest loses to L3's slowest, else not separable in this run."""

    def row(*runs):  # 100 new tokens, median of the runs
        return {"new_tokens": 100, "runs": list(runs), "seconds": sorted(runs)[len(runs) // 2],
                "tok_s": 100 / sorted(runs)[len(runs) // 2]}  # fmt: skip

    def decided(l4, l3):
        results = {"systems": {"L4": {"b": l4}, "L3": {"b": l3}}}
        (target,) = report.ratio_target(results, report.speeds(results), "t", "L4", "L3", "b", 1.0)
        return target["met"], target["measured"]

    assert decided(row(0.94, 0.95, 0.96), row(1.0, 1.0, 1.01)) == (
        True, "L4 1.05x L3 (105.3 vs 100.0 tok/s; runs 104.2-106.4 vs 99.0-100.0)",
    )  # fmt: skip
    assert decided(row(0.80, 0.95, 1.02), row(1.0, 1.0, 1.01))[0] is None
    assert decided(row(1.02, 1.03, 1.04), row(1.0, 1.0, 1.01))[0] is False
    assert decided(row(0.95), row(1.0))[1] == "L4 1.05x L3 (105.3 vs 100.0 tok/s)"  # timed once: no spread
    assert [report.VERDICTS[m] for m in (True, False, None)] == ["met", "missed", "not separable in this run"]
    assert report.run_rates({"tok_s": 10.0, "seconds": 2.0, "runs": [2.0, 4.0]}) == [10.0, 5.0]


def test_agreement_records_hf_gap_where_each_output_differs():
    """HF [5, 9, 4] with top-2 gaps [2.0, 1e-4, 0.5]: a difference at token 1 is a tie, at token 2 a
    mismatch (gap 0.5), and a missing token a mismatch with no gap to compare."""
    hf = Reference([5, 9, 4], [2.0, 1e-4, 0.5])
    got = measure.agreement([[5, 9, 4], [5, 7, 1], [5, 9, 1], [5, 9]], [hf] * 4)
    assert got == {
        "match": 1,
        "ties": {"1": "tie@1"},
        "mismatches": {"2": "DIFF@2", "3": "DIFF@2"},
        "hf_gaps": {"1": 1e-4, "2": 0.5, "3": None},
    }


def test_a_peers_disagreement_is_reported_and_a_stages_fails_the_bench():
    """Issue 46's GPU run: HF batched (a peer) differed from HF batch 1 at request 29, token 102, every
    stage agreeing, and the bench exited 1. A peer's disagreement is now printed and recorded; a
    stage's, or a stage's fast path's, still fails the run."""

    def agreeing(mismatches=None, gaps=None):
        return {"agreement": {"match": 32 - len(mismatches or {}), "ties": {}, "mismatches": mismatches or {},
                              "hf_gaps": gaps or {}}}  # fmt: skip

    results = {
        "systems": {
            "HF batch 1": {"b": {"tok_s": 1.0}},
            "HF batched": {"b": agreeing({"29": "DIFF@102"}, {"29": 0.83})},
            "HF generate_batch": {"b": agreeing()},
            "L4": {"b": agreeing(), "u": agreeing()},
            "L4 + decode graphs": {"b": agreeing()},
        }
    }
    found = report.disagreements(results)
    assert found == [
        {"system": "HF batched", "peer": True, "workload": "b", "request": 29, "token": 102,
         "tie_rule_applied": False, "hf_top2_gap": 0.83}
    ]  # fmt: skip
    status, text = report.verdict(found)
    assert status == 0 and "FAILED" not in text
    assert text.splitlines() == [
        "peers differ from HF batch 1 (reported, not a failure: a peer is not the course's code):",
        "  HF batched (b): request 29 differs from HF batch 1 at token 102; HF's top-2 logit gap there is "
        "0.83, not below the tie rule's 0.001: not a tie",
    ]
    results["systems"]["L4 + decode graphs"]["b"] = agreeing({"3": "DIFF@5"}, {"3": None})
    status, text = report.verdict(report.disagreements(results))
    assert status == 1 and "HF batched (b): request 29" in text  # the peer's line stays
    assert text.splitlines()[-2:] == [
        "bench FAILED: outputs differ from HF batch 1 beyond the tie rule:",
        "  L4 + decode graphs (b): request 3 differs from HF batch 1 at token 5; one of them generated no "
        "token there, which is never a tie",
    ]
    assert report.verdict([]) == (0, "")


def test_quick_profile_of_batch1_decode(capsys):
    """--workload a: one request; every step after its prefill is a one-row decode step."""
    assert profile.main(["--quick", "--device", "cpu", "--workload", "a", "--stages", "L3,L6"]) == 0
    out = capsys.readouterr().out
    steps = re.search(r"\| steps \| (\d+) steps \| (\d+) decode \|", out)
    assert steps and int(steps[2]) == int(steps[1]) - 1 == workloads.QUICK["a_tokens"] - 1, out
    assert re.search(rf"L6: {workloads.QUICK['a_tokens'] - 1} decode steps on the device", out), out


def test_quick_matvec_times_every_product_of_a_token(tiny_llama_dir, capsys):
    """bench.matvec: a row per weight name with one product per layer (the head once), and the whole
    token's row counting every matrix a decode token reads, checked against the checkpoint itself."""
    from kvcourse.config import ModelConfig
    from kvcourse.model import load_weights

    assert matvec.main(["--quick", "--model", str(tiny_llama_dir)]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines()]
    cells = {row[0]: row[1:] for row in rows if len(row) == 10}
    weights = load_weights(tiny_llama_dir, ModelConfig.from_dir(tiny_llama_dir))
    for name, ws in matvec.weight_groups(weights).items():
        shape, products, mb = cells[name][:3]
        assert shape == " x ".join(map(str, ws[0].shape)) and int(products) == len(ws), (name, cells[name])
        assert float(mb) == pytest.approx(sum(w.nbytes for w in ws) / 1e6, abs=0.05)
    matrices = [getattr(layer, name) for layer in weights.layers for name in matvec.LAYER_WEIGHTS]
    matrices.append(weights.lm_head)
    products, mb = cells["whole token"][1:3]
    assert int(products) == len(matrices) == 7 * len(weights.layers) + 1
    assert float(mb) == pytest.approx(sum(w.nbytes for w in matrices) / 1e6, abs=0.05)
    assert "One token's products: torch" in out and "copy bandwidth measured in the same run" in out


def test_quick_matvec_of_several_rows_reports_each_librarys_rate_and_writes_json(tiny_llama_dir, tmp_path, capsys):
    """``bench.matvec --rows N``: the products of a batched step, each group's FLOPs counted from the
    checkpoint (2 x N x out x in a product), XLA's time over torch's, and the JSON with its provenance."""
    from kvcourse.config import ModelConfig
    from kvcourse.model import load_weights

    out_file = tmp_path / "matmuls.json"
    assert matvec.main(["--quick", "--model", str(tiny_llama_dir), "--rows", "4", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "| XLA / torch time |" in out and "whole step of 4 rows" in out
    results = json.loads(out_file.read_text())
    assert results["rows"] == 4 and results["command"].startswith("python -m bench.matvec --rows 4")
    assert results["commit"] and results["machine"]["cores"]
    weights = load_weights(tiny_llama_dir, ModelConfig.from_dir(tiny_llama_dir))
    groups = {row["weight"]: row for row in results["groups"]}
    for name, ws in matvec.weight_groups(weights).items():
        assert groups[name]["GFLOP"] == pytest.approx(2 * 4 * sum(w.numel() for w in ws) / 1e9)
        assert groups[name]["torch"]["seconds"] > 0 and groups[name]["XLA"]["seconds"] > 0
    whole = groups["whole step of 4 rows"]
    assert whole["GFLOP"] == pytest.approx(sum(groups[n]["GFLOP"] for n in matvec.weight_groups(weights)))


@pytest.mark.parametrize("rows", ["0", "16385"])
def test_matvec_rejects_rows_out_of_range(capsys, rows):
    with pytest.raises(SystemExit):
        matvec.main(["--quick", "--rows", rows])
    assert f"--rows must be between 1 and 16384, got {rows}" in capsys.readouterr().err


def test_matvec_rejects_zero_repeats(capsys):
    with pytest.raises(SystemExit):
        matvec.main(["--quick", "--repeats", "0"])
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err


def test_first_runs_table_marks_one_request_warmups():
    row = {"warmup_seconds": 1.25, "seconds": 90.0, "runs": [90.0], "requests": 32, "warmup_requests": 1}
    older = {"warmup_seconds": 1.25, "seconds": 90.0, "runs": [90.0]}  # a JSON from before warmup_requests
    whole = {"warmup_seconds": 25.6, "seconds": 14.1, "runs": [18.5, 14.1, 12.6], "requests": 32,
             "warmup_requests": 32}  # fmt: skip
    results = {
        "sizes": {"repeats": 3},
        "systems": {"A": {"b": row}, "B": {"b": older}, "C": {"b": whole}, "D": {}},
    }
    assert report.first_runs_table(results)[2:] == [
        "| A | 1.2 (1 request) / 90.0 |",
        "| B | 1.2 (1 request) / 90.0 |",
        "| C | 25.6 / 14.1 |",
        "| D | - |",
    ]


@pytest.mark.slow
def test_quick_kernel_table_checks_and_times_every_kernel(tmp_path, capsys):
    """bench.kernels on tiny decode shapes: every system, the sweep's launches included, agrees with dense
    attention and is timed; the table shows the fastest launch of the sweep."""
    out = tmp_path / "kernels.json"
    assert kernels.main(["--quick", "--device", "cpu", "--sweep", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    systems = {r["system"] for r in results["rows"]}
    assert {"paged kernel (Triton)", "gather + SDPA", "SDPA contiguous"} <= systems
    assert set(kernels.DECODE_LAUNCHES) <= systems  # the launch before, and each change alone
    assert len([s for s in systems if s.startswith("Triton tile")]) == len(kernels.sweep_configs(quick=True))
    assert all(r["max_error"] < kernels.TOLERANCE and r["ms"] > 0 for r in results["rows"])
    # on a CPU every run is kept (2 with --quick) and the table quotes the fastest and the slowest
    assert all(
        len(r["ms_runs"]) == 2 and min(r["ms_runs"]) <= r["ms"] <= max(r["ms_runs"]) for r in results["rows"]
    )
    assert results["omp_wait_policy"]
    table = capsys.readouterr().out
    assert table.count("Triton, fastest of 2 launches") == len(kernels.QUICK_SHAPES), table
    assert re.search(r"\| SDPA contiguous \| [\d.]+ \([\d.]+-[\d.]+\) \|", table), table


@pytest.mark.slow
def test_quick_prefill_table_times_query_tiles_against_the_kernel_before_them(tmp_path, capsys):
    """bench.kernels --prefill on tiny prompts: the query-tiled Triton kernel, the kernel as it was before
    query tiles, the C++ kernel where it builds and SDPA's causal attention all agree with dense
    attention and are timed, each with its speedup over the kernel before query tiles."""
    pytest.importorskip(
        "triton", reason="triton is installed on Linux only; the Triton kernel is not tested here"
    )
    out = tmp_path / "prefill.json"
    assert kernels.main(["--quick", "--prefill", "--device", "cpu", "--sweep", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    systems = {r["system"] for r in rows}
    assert {"paged kernel (Triton)", kernels.BEFORE, "SDPA contiguous, causal"} <= systems, systems
    assert set(kernels.PREFILL_LAUNCHES) <= systems, systems
    assert len([s for s in systems if s.startswith("Triton rows")]) == len(
        kernels.prefill_sweep_configs(quick=True)
    )
    assert all(r["max_error"] < kernels.TOLERANCE and r["ms"] > 0 for r in rows)
    assert all(r["x_before"] == 1 for r in rows if r["system"] == kernels.BEFORE)
    table = capsys.readouterr().out
    assert "| x before query tiles |" in table and table.count("Triton, fastest of 2 launches") == 2, table


def test_quick_interpreter_table_runs_each_step_on_its_prompts(tmp_path, capsys):
    """bench.kernels --interpreter on tiny prompts: the steps before the NumPy reductions on the shortest
    prompt only, the kernel as it is on every prompt, each checked against dense attention."""
    pytest.importorskip(
        "triton", reason="triton is installed on Linux only; the Triton kernel is not tested here"
    )
    out = tmp_path / "interpreter.json"
    assert kernels.main(["--quick", "--interpreter", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    short, long = kernels.QUICK_INTERPRETER_PROMPTS
    assert [r["prompt"] for r in rows] == [short] * 4 + [long]
    assert all(r["max_error"] < kernels.TOLERANCE and r["seconds"] > 0 for r in rows)
    assert "| 24 | query tiles, the interpreter's launch shape (choose_launch) |" in capsys.readouterr().out


def test_prefill_flops_docstring_example():
    assert kernels.prefill_flops((1, 2048, 9, 3, 64)) == 4_834_197_504


def test_a_wrong_kernel_fails_the_kernel_table(tmp_path, monkeypatch, capsys):
    """An attention that answers wrongly is not timed: its row reads WRONG and the run exits 1."""
    monkeypatch.setattr(
        kernels, "paged_kernels", lambda device, quick: {"off by one": lambda q, *rest: q + 1}
    )
    assert kernels.main(["--quick", "--device", "cpu", "--out", str(tmp_path / "k.json")]) == 1
    out = capsys.readouterr().out
    assert "| off by one | WRONG |" in out and "kernels FAILED" in out


def test_kernel_table_sizes():
    assert kernels.kv_bytes((32, 512, 9, 3, 64)) == 25_165_824
    assert kernels.programs_per_sm(128, 4, 0) == 4  # the docstring's example
    assert kernels.programs_per_sm(64, 8, 100 * 1024) == 2  # shared memory binds first


def test_meta_case_has_the_kernel_tables_shapes_strides_and_dtypes():
    """``--resources`` specializes launches on meta tensors: they must be the tables' tensors but for
    their numbers."""
    for shape in (*kernels.QUICK_SHAPES, (3, 40, 9, 3, 64)):
        for prefill, case in ((False, kernels.decode_case), (True, kernels.prefill_case)):
            real, meta = case(shape, torch.device("cpu")), kernels.meta_case(shape, prefill)
            assert [(t.shape, t.stride(), t.dtype) for t in meta] == [
                (t.shape, t.stride(), t.dtype) for t in real
            ], (shape, prefill)


class NoGPU:
    """All that ``JITFunction.run`` asks of Triton's driver before it compiles: a device, its stream, and
    the target to compile for (an H100's, here)."""

    def get_current_device(self):
        return "an H100 that is not there"

    def get_current_stream(self, device):
        return None

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def test_resources_specialize_each_launch_as_the_jit_does(monkeypatch):
    """The source ``--resources`` compiles for a launch is the one the JIT would compile for it: the JIT
    itself runs on the launch (its driver stood in for, its compile hook answering "done" so that it
    compiles nothing) and what it asks to compile is compared, field by field. A build without the
    JIT's attributes took 216 registers a thread where the JIT's took 62 (issue 46)."""
    pytest.importorskip("triton.backends.nvidia", reason="this triton has no NVIDIA backend")
    from triton import knobs
    from triton.runtime.driver import driver

    from L4_paged_kernel.fast.triton_paged_attention import LaunchConfig, triton_paged_attention

    requests = []
    monkeypatch.setattr(driver, "_active", NoGPU())
    monkeypatch.setattr(
        knobs.runtime, "jit_cache_hook", lambda compile, **_: requests.append(compile) or True
    )
    target = NoGPU().get_current_target()
    launches = []
    for shape, prefill, splits in (((32, 512, 9, 3, 64), False, 4), ((1, 2048, 32, 8, 128), True, 1)):
        with kernels.recorded_launches(run=False) as recorded:
            triton_paged_attention(
                *kernels.meta_case(shape, prefill), num_splits=splits, config=LaunchConfig()
            )
        launches += recorded
    assert len(launches) == 3  # the decode launch's attention and merge, the prefill's attention
    for launch in launches:
        source, options = kernels.jit_source(launch, target)
        requests.clear()
        assert launch.kernel[(1,)](*launch.args, **launch.kwargs) is None  # the hook compiled nothing
        (asked,) = requests
        assert asked["signature"] == source.signature and asked["constants"] == source.constants
        assert asked["configs"] == [source.attrs]
        assert [asked[k] for k in ("num_warps", "num_stages", "enable_fp_fusion")] == [
            options.num_warps, options.num_stages, options.enable_fp_fusion
        ]  # fmt: skip
    # what the specialization says of the decode launch's attention, by hand
    source, _ = kernels.jit_source(launches[0], target)
    position = launches[0].kernel.arg_names.index
    aligned = [["tt.divisibility", 16]]
    assert source.attrs[position("k_ptr"),] == source.attrs[position("stride_bt"),] == aligned  # 32 blocks
    assert source.attrs[position("stride_mt"),] == []  # 9 heads a token: not a multiple of 16
    source, _ = kernels.jit_source(launches[2], target)
    assert source.constants[position("num_seqs"),] == 1  # one prompt: num_seqs is a constant


def test_kernel_resources_read_the_jits_build(tmp_path, capsys):
    """Registers and local bytes of the kernel the JIT builds for an H100, read without a GPU: at 9/3 x 64
    in the launch before the prefetch, 62 registers with Triton 3.6.0 and 3.7.1 (216 for a build
    without the JIT's specialization). One row per kernel, with the launches and shapes that run it;
    ``--out`` writes the rows with the commit and date the chapter's table quotes."""
    nvidia = pytest.importorskip("triton.backends.nvidia", reason="this triton has no NVIDIA backend")
    for tool in ("ptxas", "cuobjdump"):  # Triton's NVIDIA backend ships both: the build, the reading
        if not (Path(nvidia.__path__[0]) / "bin" / tool).exists():
            pytest.skip(f"no {tool} in {Path(nvidia.__path__[0]) / 'bin'}")
    (row,) = kernels.resources({"before": kernels.BEFORE_LAUNCH}, [(32, 512, 9, 3, 64)])
    assert 0 < row["registers"] < 128 and row["local_bytes"] == 0, row
    assert row["programs_per_sm"] >= 4 and row["shapes"] == ["32 x 512 (9/3 x 64)"]
    out = tmp_path / "resources.json"
    assert kernels.main(["--resources", "--quick", "--out", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    results = json.loads(out.read_text())
    assert results["target"] == "sm_90" and results["commit"] and results["date"], results
    assert kernels.resources_results_table(results).splitlines() == table
    assert table[0].startswith("| launches | shapes | rows | tile | warps | stages | prefetch | dots | registers |")
    # a build per launch and shape, but the launch before with one split and with "auto" (one build)
    assert len(table) == 2 + len(kernels.QUICK_SHAPES) * (len(kernels.DECODE_LAUNCHES) - 1), table


def test_kernel_resources_show_the_default_decode_launch_prefetching_without_spills():
    """The decode default, compiled for an H100 as the JIT builds it at the table's head dims 64 and
    128: no spill, and every global load of the key loop issues before its first dot instruction (the
    next tile is in flight while this one computes). The launch before it issued the next tile's loads
    after the math, and spilled at 128."""
    nvidia = pytest.importorskip("triton.backends.nvidia", reason="this triton has no NVIDIA backend")
    if not (Path(nvidia.__path__[0]) / "bin" / "cuobjdump").exists():
        pytest.skip(f"no cuobjdump in {Path(nvidia.__path__[0]) / 'bin'}")
    shapes = [kernels.SHAPES[1], kernels.SHAPES[3]]  # 32 x 4,096 (9/3 x 64), 64 x 4,096 (32/8 x 128)
    rows = kernels.resources({"default": None, "before": kernels.BEFORE_LAUNCH}, shapes)
    default = [r for r in rows if r["launches"] == ["default"]]
    before = [r for r in rows if r["launches"] == ["before"]]
    assert len(default) == len(before) == 2, rows
    for r in default:
        assert r["prefetch"] and r["precision"] == "tf32x3" and r["local_bytes"] == 0, r
        assert r["loads_before_math"] and r["global_loads_at"][1] < r["dot_math_at"][0], r
    for r in before:
        assert not r["loads_before_math"] and r["global_loads_at"][0] > r["dot_math_at"][0], r
    assert [r["local_bytes"] > 0 for r in before] == [False, True], before  # 128 spilled


def test_a_gpu_rows_registers_are_the_compiled_kernels_it_ran(monkeypatch):
    """On a GPU each row of the kernel table records the registers and local bytes of the compiled kernel
    its launch ran (what ``kernel[grid](...)`` returned); here a stand-in kernel returns a stand-in
    compiled kernel, and a table with such rows shows them in a last column."""
    pytest.importorskip(
        "triton", reason="triton is installed on Linux only; the Triton kernel is not tested here"
    )
    from L4_paged_kernel.fast import triton_paged_attention as module

    compiled = SimpleNamespace(n_regs=255, n_spills=74)  # Triton's n_spills: local bytes / 4

    class Kernel:  # launched as the JIT's are, kernel[grid](*args, **kwargs), returning its compiled kernel
        def __getitem__(self, grid):
            return lambda *args, **kwargs: compiled

    monkeypatch.setitem(module.KERNELS, False, (Kernel(), Kernel()))
    case = kernels.meta_case((2, 40, 9, 3, 64), prefill=False)
    with kernels.recorded_launches() as launches:
        module.triton_paged_attention(*case, num_splits=1)  # "auto" would ask a GPU for its size
    assert kernels.ran_resources(launches) == {"registers": 255, "local_bytes": 296}
    assert kernels.ran_resources([]) == {}  # SDPA's row, the C++ kernel's, the interpreter's
    row = {"shape": "2 x 40 (9/3 x 64)", "max_error": 1e-7, "ms": 1.0, "GBps": 1.0, "of_copy": 0.5}
    results = {"device_name": "H100", "copy_bandwidth_GBps": 3000.0,
               "rows": [row | {"system": "paged kernel (Triton)", "registers": 62, "local_bytes": 0},
                        row | {"system": "SDPA contiguous"}]}  # fmt: skip
    table = kernels.table(results)
    assert "| max error | registers / local bytes a thread |" in table
    assert "| paged kernel (Triton) | 1.000 | 1 | 50% | 1.0e-07 | 62 / 0 |" in table
    assert "| SDPA contiguous | 1.000 | 1 | 50% | 1.0e-07 | - |" in table
    del results["rows"][0]["registers"]  # a CPU run's rows: the table as it always was
    assert "registers" not in kernels.table(results)


@pytest.mark.cuda
def test_prefill_table_on_a_gpu(tmp_path):
    done = gpu_run(["bench.kernels", "--quick", "--prefill", "--device", "cuda", "--sweep", "--out",
                    str(tmp_path / "p.json")], tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert {"paged kernel (Triton)", kernels.BEFORE} <= {r["system"] for r in rows}
    triton = [r for r in rows if r["system"].startswith(("paged kernel (Triton)", "Triton"))]
    assert all(0 < r["registers"] <= 255 and r["local_bytes"] >= 0 for r in triton), triton
    assert "| registers / local bytes a thread |" in done.stdout


@pytest.mark.cuda
def test_kernel_table_on_a_gpu(tmp_path):
    done = gpu_run(["bench.kernels", "--quick", "--device", "cuda", "--sweep", "--out", str(tmp_path / "k.json")],
                   tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "k.json").read_text())
    assert "paged kernel (Triton)" in {r["system"] for r in results["rows"]}
    assert results["device_name"] in done.stdout
    # the registers and local bytes of the compiled kernel each Triton row ran, as the driver reported them
    triton = [r for r in results["rows"] if r["system"].startswith(("paged kernel (Triton)", "Triton"))]
    assert all(0 < r["registers"] <= 255 and r["local_bytes"] >= 0 for r in triton), triton
    assert not any("registers" in r for r in results["rows"] if "SDPA" in r["system"])


def test_quick_decode_cost_reads_kv_by_position_and_times_each_step(tiny_llama_dir, tmp_path, capsys):
    """bench.decode_cost (the L1 chapter's table): a row per position, the KV bytes it reads from the
    model's config (positions 0..t), a no-cache forward for every position but the first."""
    from bench import decode_cost
    from kvcourse.config import ModelConfig

    out = tmp_path / "cost.json"
    assert decode_cost.main(["--quick", "--model", str(tiny_llama_dir), "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    per_token = ModelConfig.from_dir(tiny_llama_dir).kv_bytes_per_token()
    assert [r["position"] for r in results["rows"]] == list(decode_cost.QUICK_POSITIONS)
    assert [r["kv_read_bytes"] for r in results["rows"]] == [
        per_token * (p + 1) for p in decode_cost.QUICK_POSITIONS
    ]
    assert results["rows"][0]["no_cache_ms"] is None
    assert all(r["no_cache_ms"] > 0 and r["step_ms"] > 0 for r in results["rows"][1:])
    assert (
        results["command"] == "python -m bench.decode_cost" and "| position `t` |" in capsys.readouterr().out
    )


def test_quick_reference_kernel_table_checks_every_way_against_l3(tmp_path, monkeypatch, capsys):
    """bench.reference_kernel (the L4 chapter's table): every way agrees with L3's gather first, and a
    way that does not fails the run instead of being timed."""
    from bench import reference_kernel

    out = tmp_path / "ref.json"
    assert reference_kernel.main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["shape"] for r in rows] == [f"{b} x {c}" for b, c in reference_kernel.QUICK_SHAPES]
    assert all(r["L4 reference"] > 0 and r["L4 decode tiles (fast/)"] > 0 for r in rows)
    monkeypatch.setattr(reference_kernel, "split_kv_attention", lambda *a, **k: torch.zeros(1))
    with pytest.raises(AssertionError, match="L4 decode tiles"):
        reference_kernel.main(["--quick", "--out", str(tmp_path / "wrong.json")])


def test_quick_sharing_counts_what_each_way_of_sharing_saves(tiny_qwen3_dir, tmp_path, capsys):
    """bench.sharing (the L5 chapter's section 8 tables): the three ways of running each workload give
    the same tokens, and the counters order as sharing says: nothing shared holds the most blocks and
    runs the most tokens, the one-after-another run holds one request's blocks at a time."""
    from bench import sharing

    out = tmp_path / "sharing.json"
    assert sharing.main(["--quick", "--model", str(tiny_qwen3_dir), "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    cloned, cached, unshared = results["sampled"]["rows"].values()
    assert unshared["blocks_shared"] == unshared["prefix_cache_hits"] == 0
    assert cloned["tokens_run"] < cached["tokens_run"] < unshared["tokens_run"]
    assert cloned["blocks_held"] < unshared["blocks_held"]
    at_once, uncached, one_by_one = results["system_prompt"]["rows"].values()
    assert (
        uncached["prefix_cache_hits"] == 0
        and at_once["prefix_cache_hits"] == one_by_one["prefix_cache_hits"] > 0
    )
    assert at_once["tokens_run"] + at_once["prefill_skipped"] == uncached["tokens_run"]
    assert one_by_one["blocks_held"] < at_once["blocks_held"]
    assert results["command"] == "python -m bench.sharing" and results["commit"]
    assert "| run | blocks held at peak |" in capsys.readouterr().out


def test_sharing_refuses_runs_whose_tokens_differ():
    """Sharing must change no token: a run that gives other tokens fails the bench, naming it."""
    from bench import sharing

    with pytest.raises(AssertionError, match="'unshared' gave other tokens than 'cloned'"):
        sharing.same({"cloned": [[1, 2]], "unshared": [[1, 3]]}, "sampled clones")


def test_quick_agreement_runs_each_way_against_hf_batch1(capsys):
    """``bench.agreement --quick`` on a CPU: HF batch 1, then L4 once per kernel the CPU has, each
    compared with the tie rule; on the tiny model every request matches."""
    from bench import agreement

    assert agreement.main(["--quick", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    n = workloads.QUICK["b_requests"]
    lines = [line for line in out.splitlines() if "= HF batch 1" in line]
    assert any(line.startswith("PyTorch reference kernel") for line in lines), out
    assert len(lines) == (1 if PROBLEM else 2) and all(f" {n}/{n} = HF batch 1" in line for line in lines), out


def test_agreement_forces_a_precision_on_every_launch_and_puts_it_back():
    """The GPU ways force the Triton dots' precision: the launch ``choose_launch`` picks and the full-grid
    decode launch both carry it inside the context, and both are as before after it."""
    from bench.agreement import forced, ways
    from L4_paged_kernel.fast import triton_paged_attention as tpa

    before = (tpa.choose_launch, tpa.FULL_GRID_DECODE)
    with forced("ieee"):
        assert tpa.choose_launch(32, 32, 3, 4096, interpreted=False).precision == "ieee"
        assert tpa.FULL_GRID_DECODE.precision == "ieee" and tpa.FULL_GRID_DECODE.tile_n == 32
    assert (tpa.choose_launch, tpa.FULL_GRID_DECODE) == before and before[1].precision == "tf32x3"
    gpu = ways(gpu=True)
    assert {p for _, p in gpu.values()} == {"ieee", "tf32x3", None} and len(gpu) == 5
