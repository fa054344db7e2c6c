"""The benchmark code runs end to end on tiny sizes, so ``make bench`` cannot rot between runs.

Nothing here checks a speed: timing asserts would only measure how busy the machine is.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
from cpp_kernel import PROBLEM

from bench import ceilings, matvec, measure, profile, report, run, workloads


def test_quick_bench_writes_results_and_plots(tmp_path, capsys):
    assert run.main(["--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results" / "bench.json").read_text())
    systems, sizes = results["systems"], results["sizes"]
    budgets = workloads.mixed_workload(49152, sizes["b_requests"], sizes["b_prompt"], sizes["b_new"])[1]
    assert {"HF batch 1", "HF batched", "HF generate_batch", "L1"} <= set(systems)
    for name, row in systems.items():
        assert {"b", "c"} <= set(row), name
        assert row["b"]["tok_s"] > 0 and row["b"]["new_tokens"] == sum(budgets)
        assert len(row["b"]["runs"]) in (1, sizes["repeats"]) and row["b"]["warmup_seconds"] > 0
        one_at_a_time = name in ("HF batch 1", "L1", "L2")  # warmed up on the first request only
        assert row["b"]["warmup_requests"] == (1 if one_at_a_time else len(budgets)), name
        if name != "HF batch 1":  # every other system's outputs equal HF batch 1's (tie rule)
            assert not row["b"]["agreement"]["mismatches"], name
            assert row["b"]["agreement"]["match"] + len(row["b"]["agreement"]["ties"]) == len(budgets), name
        if name.startswith("L"):
            assert 0 < row["b_kv"]["utilization"] <= 1, name
            assert set(row["d"]) == {str(c) for c in sizes["d_contexts"]}
        if "c_kv" in row:  # prefilled once and forked: fewer blocks than private copies
            assert 0 < row["c_kv"]["blocks_held"] < row["c_kv"]["private_copies_blocks"], name
    assert results["stage_options"]["L4"].get("kernel") == ("cpp" if PROBLEM is None else None)
    assert bool(results["cpp_kernel_problems"]) == (PROBLEM is not None)
    assert systems["HF batched"]["b"]["computed_new_tokens"] == len(budgets) * max(budgets) > sum(budgets)
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
    assert "| whole token |" in out and "XLA's matrix-vector products alone ((f)) would allow" in out
    # the tables again from the saved file, measurements untouched; the plots into a folder not made yet
    again_plots = tmp_path / "plots again"
    assert report.main([str(tmp_path / "results" / "bench.json"), "--plots", str(again_plots)]) == 0
    assert (again_plots / "throughput.png").stat().st_size > 0
    again = capsys.readouterr().out.strip()
    assert again and again in out


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
    prompts, budgets = workloads.mixed_workload(100, 5, (10, 20), (3, 4), seed=1)
    assert (prompts, budgets) == workloads.mixed_workload(100, 5, (10, 20), (3, 4), seed=1)
    assert all(10 <= len(p) <= 20 and all(3 <= t < 100 for t in p) for p in prompts)
    assert all(3 <= b <= 4 for b in budgets)


def test_quick_profile_splits_a_step_into_its_parts(capsys):
    l4 = "L4:cpp" if PROBLEM is None else "L4:torch"  # the C++ kernel where this machine could build it
    assert profile.main(["--quick", "--stages", f"L3,{l4},L6"]) == 0
    out = capsys.readouterr().out
    for part in (*profile.PARTS, "prefill", "decode", "host_state", "host Python"):
        assert f"| {part} |" in out
    assert f"{l4} ms/decode step" in out and "decode steps on the device" in out


def test_quick_profile_of_batch1_decode(capsys):
    """--workload a: one request; every step after its prefill is a one-row decode step."""
    assert profile.main(["--quick", "--workload", "a", "--stages", "L3,L6"]) == 0
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
