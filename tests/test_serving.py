"""The request stream and the serving metrics (issues 35, 44): arrivals, synthetic length mixes, traces,
TTFT / TPOT / end-to-end / normalized latency computed on a hand-made timeline, the memory breakdown
(the paper's Fig. 2) on hand-worked steps and a hand-built allocator state; ``serve`` on a tiny
checkpoint with a fake clock, under every admission policy at a pool that makes requests wait, its
outputs equal to HF greedy's."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from kvcourse.engine_config import ADMISSION_POLICIES, EngineConfig
from kvcourse.harness.reference import hf_greedy
from kvcourse.harness.serving import (
    Timeline,
    memory_breakdown,
    memory_now,
    percentile,
    request_metrics,
    serve,
    summary,
)
from kvcourse.harness.stream import MIXES, Request, at_rate, poisson_arrivals, read_trace, synthetic_stream
from kvcourse.orca import BuddyAllocator
from L3_block_tensor.allocator import BlockAllocator, OutOfBlocksError
from L3_block_tensor.engine import Engine as L3Engine


def test_poisson_arrivals_have_the_rate_asked_for():
    times = poisson_arrivals(4000, 5.0, seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    assert math.isclose((times[-1] - times[0]) / (len(times) - 1), 1 / 5.0, rel_tol=0.05)
    assert poisson_arrivals(5, 5.0, 1) == times[:5]  # seeded
    with pytest.raises(ValueError, match="rate must be > 0 requests/s, got 0"):
        poisson_arrivals(3, 0, 1)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_synthetic_mixes_have_the_papers_means(mix):
    reqs = synthetic_stream(mix, 3000, 1.0, 7, vocab_size=1000, max_model_len=100_000)
    prompt = sum(len(r.prompt_ids) for r in reqs) / len(reqs)
    output = sum(r.max_new_tokens for r in reqs) / len(reqs)
    assert math.isclose(prompt, MIXES[mix]["input_mean"], rel_tol=0.1)
    assert math.isclose(output, MIXES[mix]["output_mean"], rel_tol=0.1)
    assert all(3 <= t < 1000 for r in reqs[:50] for t in r.prompt_ids)


def test_streams_fit_max_model_len_and_keep_their_requests_at_another_rate():
    reqs = synthetic_stream("sharegpt", 200, 2.0, 3, vocab_size=500, max_model_len=64)
    assert all(len(r.prompt_ids) + r.max_new_tokens <= 64 and r.max_new_tokens >= 1 for r in reqs)
    faster = at_rate(reqs, 8.0, 3)
    assert [(r.prompt_ids, r.max_new_tokens) for r in faster] == [
        (r.prompt_ids, r.max_new_tokens) for r in reqs
    ]
    assert faster[-1].arrival < reqs[-1].arrival


def test_read_trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [
        {"arrival": 1.5, "prompt_len": 4, "output_len": 2},
        {"arrival": 0.0, "prompt_ids": [5, 6], "output_len": 3},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    reqs = read_trace(path, vocab_size=100)
    assert [(r.arrival, len(r.prompt_ids), r.max_new_tokens) for r in reqs] == [(0.0, 2, 3), (1.5, 4, 2)]
    assert reqs[0].prompt_ids == [5, 6]
    path.write_text('{"arrival": 0.0, "output_len": 3}\n')
    with pytest.raises(
        ValueError, match="trace.jsonl:1: expected arrival, output_len and prompt_len or prompt_ids"
    ):
        read_trace(path, vocab_size=100)


def test_latency_metrics_on_a_hand_made_timeline():
    """Two requests: A arrives at 0, first token at 0.5, its 5th and last at 1.3; B arrives at 1.0, one
    token at 2.0. By hand: A's TTFT 0.5, TPOT (1.3 - 0.5) / 4 = 0.2, end-to-end 1.3, normalized
    1.3 / 5 = 0.26; B's TTFT 1.0, no TPOT, end-to-end 1.0, normalized 1.0."""
    t = Timeline([0.0, 1.0], [0.5, 2.0], [1.3, 2.0], [[1] * 5, [2]], preemptions=1, end=2.0)
    t.steps = [
        {"t": 0.5, "dt": 0.5, "held": 32, "tables": 32, "fill": 12, "live": 8, "external": 0, "pool": 64, "waiting": 0},
        {"t": 1.0, "dt": 0.5, "held": 16, "tables": 16, "fill": 12, "live": 8, "external": 0, "pool": 64, "waiting": 0},
    ]
    a, b = request_metrics(t)
    assert a == pytest.approx({"ttft": 0.5, "tpot": 0.2, "e2e": 1.3, "normalized": 0.26, "output_tokens": 5})
    assert b == pytest.approx({"ttft": 1.0, "tpot": None, "e2e": 1.0, "normalized": 1.0, "output_tokens": 1})
    s = summary(t)
    assert s["mean_normalized_latency"] == pytest.approx((0.26 + 1.0) / 2)
    assert s["output_tokens_per_s"] == pytest.approx(6 / 2.0) and s["requests_per_s"] == pytest.approx(1.0)
    assert s["tpot_p50"] == pytest.approx(0.2) and s["ttft_p50"] == pytest.approx(0.75)
    assert s["kv_utilization"] == pytest.approx(16 / 48) and s["kv_pool_share"] == pytest.approx(16 / 128)
    assert s["preemptions"] == 1
    assert s["memory_breakdown"] is None  # nobody ever waited


def step(dt, live, fill, held, external, waiting, tables=None, pool=100):
    return {"t": 0.0, "dt": dt, "live": live, "fill": fill, "tables": held if tables is None else tables,
            "held": held, "external": external, "pool": pool, "waiting": waiting}  # fmt: skip


def test_memory_breakdown_on_hand_worked_steps():
    """A pool of 100 positions; steps after which someone waits, of 1 s and 3 s, and one of 5 s after
    which nobody does (left out). By hand, over 1 x 100 + 3 x 100 = 400 position-seconds:
    token states (20 + 120) / 400 = 0.35; reservation (10 + 30) / 400 = 0.1; internal (30 + 90) / 400
    = 0.3, of which buddy rounding (held - tables: 10 x 1 + 0 x 3) / 400 = 0.025; external (0 + 60) / 400
    = 0.15; other free (40 + 0) / 400 = 0.1."""
    steps = [step(1, 20, 30, 60, 0, 1, tables=50), step(5, 90, 95, 100, 0, 0), step(3, 40, 50, 80, 20, 2)]
    b = memory_breakdown(steps)
    assert b == pytest.approx({"token_states": 0.35, "reservation": 0.1, "internal_fragmentation": 0.3,
                               "external_fragmentation": 0.15, "other_free": 0.1,
                               "internal_of_which_buddy_rounding": 0.025, "steps": 2, "seconds": 4})  # fmt: skip
    assert memory_breakdown(steps[1:2]) is None


def waiting_behind_two_runs(admission_policy: str, max_num_seqs: int = 4):
    """8 blocks of 16, four runs of 2 handed out (0-1, 2-3, 4-5, 6-7), the first and the third given
    back: 4 blocks free, in two runs of 2 that are not buddies. Running: X (prompt 10, 15 new, 12
    computed) in 2-3 and Y (prompt 20, 5 new, 24 computed) in 6-7; waiting: Z, prompt 30 and 20 new
    (50 positions: 4 blocks, a run of 4 under Oracle)."""
    config = EngineConfig(max_model_len=128, num_blocks=8, admission_policy=admission_policy,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=128)  # fmt: skip
    allocator = BuddyAllocator(8, 16, OutOfBlocksError)
    runs = [allocator.alloc_blocks(2) for _ in range(4)]
    allocator.free(runs[0])
    allocator.free(runs[2])
    seq = SimpleNamespace
    running = [seq(prompt_ids=[1] * 10, max_new_tokens=15, num_computed_tokens=12, block_table=runs[1]),
               seq(prompt_ids=[1] * 20, max_new_tokens=5, num_computed_tokens=24, block_table=runs[3])]  # fmt: skip
    waiting = [seq(prompt_ids=[1] * 30, max_new_tokens=20, num_computed_tokens=0, block_table=[])]
    return SimpleNamespace(allocator=allocator, config=config,
                           scheduler=SimpleNamespace(running=running, waiting=waiting))  # fmt: skip


def test_memory_now_counts_external_fragmentation_only_when_contiguity_blocks_the_head():
    """By hand: live 12 + 24 = 36; fill min(32, 25) + min(32, 25) = 50; tables and held 4 blocks x 16 =
    64; pool 128; Z's run of 4 fits the 4 free blocks but not the largest free run (2), and 2 of 4
    sequence slots are taken: external = the 4 free blocks = 64 positions."""
    assert memory_now(waiting_behind_two_runs("oracle")) == {
        "live": 36, "fill": 50, "tables": 64, "held": 64, "external": 64, "pool": 128, "waiting": 1}
    no_slot = waiting_behind_two_runs("oracle", max_num_seqs=2)  # Z waits for a sequence slot too
    assert memory_now(no_slot)["external"] == 0
    paged = waiting_behind_two_runs("on_demand")
    paged.allocator = BlockAllocator(8, 16)
    paged.allocator.alloc_blocks(4)
    assert memory_now(paged)["external"] == 0  # a free list has no contiguity to lack


def test_percentile():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([], 50) is None


def test_timeline_stamps_first_and_last_token():
    t = Timeline.empty([Request(0.0, [1], 3)])
    t.tokens(0, [], 0.1)
    t.tokens(0, [7], 0.2)
    t.tokens(0, [7], 0.3)  # no new token: nothing changes
    t.tokens(0, [7, 8], 0.4)
    assert (t.first_token, t.last_token, t.outputs) == ([0.2], [0.4], [[7, 8]])
    t.tokens(0, [7, 8, 9, 10], 0.7)
    assert t.gaps(0) == pytest.approx([0.2, 0.3, 0.0])


class FakeClock:
    """Time that moves only when asked: each step takes 0.01 s, a sleep as long as asked."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 0.01
        return self.now

    def sleep(self, s):
        self.now += s


@pytest.mark.parametrize("policy", ADMISSION_POLICIES)
def test_serve_under_every_policy_at_a_binding_pool_gives_hfs_tokens(tiny_qwen3_dir, policy):
    """A pool of 16 blocks of 4 (Max's reservation of 48 is 12 blocks, one buddy run of 16): requests
    wait (and on demand, some are preempted), and every output is still HF greedy's."""
    reqs = synthetic_stream("alpaca", 6, 2.0, 5, vocab_size=49152, max_model_len=48, scale=0.3)
    kv_bytes = 16 * 4 * 512  # 16 blocks of 4 tokens, 512 bytes a token
    engine = L3Engine(
        tiny_qwen3_dir, block_size=4, kv_cache_bytes=kv_bytes, max_model_len=48, admission_policy=policy
    )
    clock = FakeClock()
    timeline = serve(engine, reqs, clock=clock, sleep=clock.sleep)
    want = [r.tokens for r in hf_greedy(tiny_qwen3_dir, [r.prompt_ids for r in reqs], [r.max_new_tokens for r in reqs])]
    assert timeline.outputs == want
    assert max(s["waiting"] for s in timeline.steps) > 0  # the pool binds
    assert all(f >= a for f, a in zip(timeline.first_token, timeline.arrivals, strict=True))
    assert all(s["live"] <= s["fill"] <= s["tables"] <= s["held"] <= s["pool"] == 64 for s in timeline.steps)
    assert all(s["external"] <= s["pool"] - s["held"] for s in timeline.steps)
    rows = request_metrics(timeline)
    assert [r["output_tokens"] for r in rows] == [r.max_new_tokens for r in reqs]
    b = summary(timeline)["memory_breakdown"]
    assert sum(b[k] for k in ("token_states", "reservation", "internal_fragmentation", "external_fragmentation",
                              "other_free")) == pytest.approx(1.0)  # fmt: skip


@pytest.mark.slow
def test_bench_serving_runs_every_system_and_checks_every_output(tiny_llama_dir, tmp_path):
    """``python -m bench.serving --plan tiny`` on a tiny checkpoint: every policy, peer and chunk size
    serves the stream to the end, every output equals HF greedy one request at a time, and every real
    run carries the simulator's prediction for the same stream beside its measurement."""
    from bench import serving as bench_serving

    assert (
        bench_serving.main(
            ["--plan", "tiny", "--model", str(tiny_llama_dir), "--out", str(tmp_path / "results")]
        )
        == 0
    )
    results = json.loads((tmp_path / "results" / "serving_tiny.json").read_text())
    n = results["plan"]["n"]
    runs = [row for by_policy in results["policies"].values() for row in by_policy]
    rows = runs + [row for name, row in results["peers"].items() if name != "rate"]
    assert len(runs) == 4 * 2 and len(rows) == 4 * 2 + 5 and all("error" not in row for row in rows), results["peers"]
    assert all(row["agreement"]["match"] + len(row["agreement"]["ties"]) == n for row in rows)
    assert all(not row["agreement"]["mismatches"] for row in rows)
    for row in runs:  # measured and simulated side by side
        measured, predicted = row["summary"]["mean_normalized_latency"], row["predicted"]["mean_normalized_latency"]
        assert row["simulated_over_measured"] == pytest.approx(predicted / measured)
        assert row["in_sample"]["fit"]["total_ratio"] == pytest.approx(1.0, abs=0.1) and row["steps"]
    assert set(results["simulated"]["policies"]) == {"on_demand", "oracle", "pow2", "max"}
    assert set(results["heldout"]) == {"35", "36"} and all("heldout" in row for row in runs)  # each seed from the other
    chunks = results["chunked_prefill"]["by_chunk"]
    assert set(chunks) == {"None", "16"} and all(not c["agreement"]["mismatches"] for c in chunks.values())
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "serving_chunked_prefill_tiny.png",
        "serving_policies_tiny.png",
    ]
    assert all(r["summary"]["kv_utilization"] < 1 for r in results["policies"]["max"])  # blocks nobody fills
    assert bench_serving.table(results).count("\n| ") >= 4 + 5 + 2


@pytest.mark.slow
def test_the_repeats_plan_calibrates_then_serves_each_stream_again(tiny_llama_dir, tmp_path, capsys):
    """``python -m bench.serving --plan tiny-repeats``: the profile is calibrated in the same command and
    prices every run; each stream is served once per repeat (the same requests, the same prediction),
    every output equals HF; the table counts the 10% checks over those runs. ``--profile`` with a
    calibrating plan is refused, naming the plan."""
    from bench import serving as bench_serving

    out = tmp_path / "results"
    assert bench_serving.main(["--plan", "tiny-repeats", "--model", str(tiny_llama_dir), "--out", str(out)]) == 0
    results = json.loads((out / "serving_tiny-repeats.json").read_text())
    plan = results["plan"]
    assert results["command"] == "python -m bench.serving --plan tiny-repeats" and "peers" not in results
    assert results["cost_profile"]["file"] is None and results["cost_profile"]["calibrated"]["fit"]["r2"] is not None
    for policy, runs in results["policies"].items():
        assert sorted(r["repeat"] for r in runs) == list(range(plan["repeats"])), policy
        assert len({r["predicted"]["mean_normalized_latency"] for r in runs}) == 1  # one stream, one prediction
        assert all(r["agreement"]["match"] + len(r["agreement"]["ties"]) == plan["n"] for r in runs)
        assert all(not r["agreement"]["mismatches"] for r in runs)
    table = bench_serving.repeats_table(results)
    pairs = len(plan["policies"]) * plan["repeats"] * (plan["repeats"] - 1)
    runs = len(plan["policies"]) * plan["repeats"]
    for line, count in zip(table.splitlines()[-5:], (runs, len(plan["policies"]), pairs, runs, runs), strict=True):
        assert f" of {count} |" in line, table
    # --rescore draws each run's requests again (it stops where the simulator's prediction for them differs
    # from the recorded one) and computes at_speed again from the recorded steps
    path = out / "serving_tiny-repeats.json"
    before = {(p, r["repeat"]): r["in_sample"]["at_speed"] for p, rs in results["policies"].items() for r in rs}
    for by_policy in results["policies"].values():
        for row in by_policy:
            del row["in_sample"]["at_speed"]
    path.write_text(json.dumps(results))
    assert bench_serving.main(["--rescore", str(path), "--model", str(tiny_llama_dir)]) == 0
    again = json.loads(path.read_text())
    assert again["rescored"]["command"] == f"python -m bench.serving --rescore {path}"
    for policy, rows in again["policies"].items():
        for row in rows:  # the recorded steps are rounded to 10 us: the same speed within 1%
            want = before[policy, row["repeat"]]
            assert row["in_sample"]["at_speed"]["speed"] == pytest.approx(want["speed"], rel=1e-2)
    row = again["policies"]["max"][0]
    row["rate"] *= 1.5  # another stream than the one run: refused, naming it
    path.write_text(json.dumps(again))
    with pytest.raises(SystemExit, match="do not draw again as they were run"):
        bench_serving.main(["--rescore", str(path), "--model", str(tiny_llama_dir)])
    (tmp_path / "other.json").write_text('{"rows": []}')  # another command's results, then no JSON at all
    (tmp_path / "broken.json").write_text('{"plan": ')
    for name in ("other.json", "broken.json"):
        with pytest.raises(SystemExit):
            bench_serving.main(["--rescore", str(tmp_path / name), "--model", str(tiny_llama_dir)])
        assert f"{tmp_path / name} is not a results file of bench.serving" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "plots").iterdir()] == ["serving_policies_tiny-repeats.png"]
    with pytest.raises(SystemExit):
        bench_serving.main(["--plan", "tiny-repeats", "--profile", "x.json", "--model", str(tiny_llama_dir)])


def test_stolen_is_the_share_of_cpu_time_given_away():
    from bench.measure import stolen

    before, after = [0] * 10, [1500, 0, 300, 100, 0, 0, 0, 100, 0, 0]  # 2,000 ticks, 100 of them steal
    assert stolen(before, after) == pytest.approx(0.05)
    assert stolen(None, after) is None and stolen(before, before) == 0.0


@pytest.mark.parametrize(
    ("steals", "retries", "kept", "tries"),
    [([0.01], 2, 0, 1), ([0.2, 0.01], 2, 1, 2), ([0.2, 0.3, 0.25], 2, 0, 3), ([0.2, 0.01], 0, 0, 1)],
)
def test_quiet_serve_runs_again_while_the_cpu_is_stolen_and_keeps_the_quietest_try(monkeypatch, steals, retries, kept, tries):
    from bench import serving as bench_serving

    served, stolen = iter(range(10)), iter(steals)
    monkeypatch.setattr(bench_serving, "timed_serve", lambda eng, reqs: (f"timeline {next(served)}", []))
    monkeypatch.setattr(bench_serving, "stolen", lambda before, after: next(stolen))
    steal, timeline, _, seen = bench_serving.quiet_serve(None, [], retries)
    assert (steal, timeline, seen) == (steals[kept], f"timeline {kept}", steals[:tries])
