"""L6 multi-host smoke: the sharded engine as several JAX processes on this machine, against L6 and HF.

    python L6_tpu_jax/l6_multihost.py [--processes P] [--devices D] [--model DIR] [--prompts FILE.jsonl]
                                      [--max-new-tokens N] [--diverge] [--timeout SECONDS]

The launcher (this process) prepares every model's prompts, HF's greedy answers (cached) and the
single-process L6 engine's tokens, then starts P "hosts": copies of this script, each a JAX process
with D / P CPU devices, joined by ``jax.distributed.initialize`` on a free localhost port with gloo
CPU collectives. Every host runs the same program: one ``MeshEngine`` (``mesh/engine.py``) over the
global ``data`` mesh of D devices, with the same-call guard on, and ``generate`` on every prompt. Each host writes the tokens it
reads from its own copy of the replicated state; host 0's report is streamed here. The launcher then
checks, prompt by prompt, that every host read the same tokens and that they equal single-process L6
and HF (the tie rule is the only tolerance). The last line is

    L6 multi-host smoke: K/K prompts match L6 and HF (P processes, D devices)

and the exit status is 0 only if every prompt matches (and, with --diverge, every demonstration
behaves as the rules say), 1 otherwise (or if a host fails or the run times out: every host is then
stopped), 2 for bad input. ``--processes 1 --devices D`` is one process
over a simulated mesh of D devices (``--xla_force_host_platform_device_count``).

``--diverge`` first demonstrates the multi-host rules on the first model, with real output:
host-only logging on host 0 changes nothing; host 1 making an extra jit call, padding its decode
batch to another width, or skipping a reset is caught by the guard on every host, which raises
``HostDivergenceError`` naming the call on each side, instead of hanging.

Without --model: the course model and a seeded random tiny Qwen3, as every smoke.
Not run here: a real TPU slice; a ``model`` mesh axis (see the chapter, section 12).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOST_LOG_TAIL = 30  # lines of a failed host's log shown


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="l6_multihost.py", description="L6 multi-host smoke check")
    p.add_argument("--processes", type=int, default=2, help="JAX processes (hosts) to start (default 2)")
    p.add_argument(
        "--devices", type=int, help="devices in all, a multiple of --processes (default: one per process)"
    )
    p.add_argument(
        "--model", help="local HF Llama/Qwen3 directory (default: the course model and a tiny Qwen3)"
    )
    p.add_argument("--prompts", help="JSONL prompt file (default: the course prompt set)")
    p.add_argument(
        "--max-new-tokens", type=int, default=64, help="per-prompt max_new_tokens unless the file sets one"
    )
    p.add_argument(
        "--diverge", action="store_true", help="first demonstrate the guard catching diverging hosts"
    )
    p.add_argument(
        "--timeout", type=float, default=1800, help="seconds before every host is stopped (default 1800)"
    )
    p.add_argument("--host", type=int, help=argparse.SUPPRESS)  # set by the launcher in each host
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.devices = args.processes if args.devices is None else args.devices
    return args


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag, its value and the limit."""
    if args.processes < 1:
        raise ValueError(f"--processes must be >= 1, got {args.processes}")
    if args.devices < args.processes or args.devices % args.processes:
        raise ValueError(
            f"--devices must be a multiple of --processes={args.processes} (each process gets the same "
            f"number of devices), got {args.devices}"
        )
    if args.diverge and args.processes < 2:
        raise ValueError(f"--diverge needs --processes >= 2 (hosts to diverge), got {args.processes}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")


def max_num_seqs_for(devices: int, wanted: int = 16) -> int:
    """The engine's slots over a mesh: ``wanted`` rounded up to a multiple of the devices.

    Example: 16 slots over 3 devices -> 18 (6 per device); over 4 -> 16.
    """
    return -(-wanted // devices) * devices


# ---- a host ----


def diverge_demos(engine, ids: list[list[int]], max_new: list[int], expected: list[list[int]]) -> list[dict]:
    """The multi-host rules, broken on purpose one at a time; returns what happened in each.

    Every host runs this same function; ``me`` decides which host misbehaves. A divergence caught by
    the guard raises on every host before the diverging call runs, so the engines stay in step and
    the next demonstration (which starts with a reset) can go on.
    """
    import jax

    from L6_tpu_jax.mesh.multihost import HostDivergenceError

    me = jax.process_index()
    demos = []

    def show(name: str, expect_caught: bool, run) -> None:
        try:
            run()
        except HostDivergenceError as e:
            demos.append({"name": name, "ok": expect_caught, "said": str(e)})
        else:
            same = engine.generate(ids, max_new) == expected
            said = "no error; outputs equal single-process L6" if same else "no error, but outputs DIFFER"
            demos.append({"name": name, "ok": same and not expect_caught, "said": said})
        print(f"  [{'ok' if demos[-1]['ok'] else 'FAILED'}] {name}: {demos[-1]['said']}", flush=True)

    def host_only_logging():
        engine.generate(ids, max_new)
        if me == 0:  # reads this host's own copy of the state: no jit call, nothing the others must join
            print(f"    host 0 only: occupancy {engine.occupancy()}; {engine.stats()}", flush=True)
            engine.check_invariants()

    def extra_call():
        plain = engine._call

        def with_extra(name, fn, *args, **kw):
            if me == 1 and name == "decode":
                engine._call("free_finished", engine._free, engine.state)
            return plain(name, fn, *args, **kw)

        engine._call = with_extra
        try:
            engine.generate(ids, max_new)
        finally:
            del engine._call

    def other_width():
        if me == 1:
            engine.decode_width = lambda host: 2 * type(engine).decode_width(engine, host)
        try:
            engine.generate(ids, max_new)
        finally:
            engine.__dict__.pop("decode_width", None)

    def skipped_reset():
        if me == 1:
            engine.reset = lambda: None
        try:
            engine.generate(ids, max_new)
        finally:
            engine.__dict__.pop("reset", None)

    print("-- divergence demonstrations (the same-call guard on every host)", flush=True)
    show("host-only logging on host 0", False, host_only_logging)
    show("an extra jit call on host 1", True, extra_call)
    show("host 1 pads its decode batch to another width", True, other_width)
    show("host 1 skips reset", True, skipped_reset)
    return demos


def collectives(compiled_hlo: str) -> list[str]:
    """The cross-device operations in compiled HLO text, with their shapes and bytes.

    Example: a line ``%psum.14 = s32[8]{0} all-reduce(...)`` -> ``["all-reduce s32[8] (32 bytes)"]``.
    """
    sizes = {"s32": 4, "f32": 4, "u8": 1, "pred": 1, "s64": 8, "f64": 8, "bf16": 2}
    found = []
    pattern = r"= (\w+)\[([\d,]*)\]\S* (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)\("
    for dtype, dims, op in re.findall(pattern, compiled_hlo):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        found.append(f"{op} {dtype}[{dims}] ({n * sizes.get(dtype, 4)} bytes)")
    return found


def host_main(args: argparse.Namespace) -> int:
    """One host: join the others, run the job's models over the global mesh, write what it read."""
    import jax

    if args.processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"localhost:{args.port}", num_processes=args.processes, process_id=args.host
        )
    from L6_tpu_jax.mesh.engine import MeshEngine
    from L6_tpu_jax.mesh.multihost import data_mesh

    job = json.loads(Path(args.job).read_text())
    mesh = data_mesh()
    me = jax.process_index()
    mine = [d.id for d in jax.local_devices()]
    print(
        f"host {me}: {jax.process_count()} processes, mesh {dict(mesh.shape)}, my devices {mine}", flush=True
    )
    report = {"models": [], "demos": []}
    for k, model in enumerate(job["models"]):
        engine = MeshEngine(
            model["model_dir"],
            mesh,
            max_model_len=model["max_model_len"],
            max_num_seqs=max_num_seqs_for(args.devices),
            guard=True,
        )
        if args.diverge and k == 0:
            few = slice(0, 2)
            max_new_tokens = [min(b, 8) for b in model["max_new_tokens"][few]]
            expected = [t[:8] for t in model["l6"][few]]
            report["demos"] = diverge_demos(engine, model["ids"][few], max_new_tokens, expected)
        t0 = time.perf_counter()
        tokens = engine.generate(model["ids"], model["max_new_tokens"])
        seconds = time.perf_counter() - t0
        n = sum(map(len, tokens))
        print(f"== {model['title']}: host {me} generated {n} new tokens in {seconds:.1f} s", flush=True)
        print(f"  host {me}: {engine.stats()}", flush=True)
        print(f"  host {me}: {engine.num_calls} jit calls, compiles {dict(engine.traces)}", flush=True)
        found = []
        if me == 0:  # compiling a program is host-only work: nothing runs, no other host takes part
            width = max_num_seqs_for(args.devices)
            hlo = (
                engine._decode.lower(engine.params, engine.state, engine.kv_pages, width).compile().as_text()
            )
            found = collectives(hlo)
            print(f"  crossing devices per decode round (compiled HLO, width {width}): {found}", flush=True)
        report["models"].append(
            {"tokens": tokens, "calls": engine.num_calls, "compiles": dict(engine.traces)}
        )
    Path(args.job).with_name(f"host{me}.json").write_text(json.dumps(report))
    return 0


# ---- the launcher ----


def free_port() -> int:
    """A localhost TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, job: Path) -> str | None:
    """Start every host, stream host 0's log, stop them all if one fails or time runs out.

    Returns None if every host exited 0, else what went wrong (with the failing host's last lines).
    """
    port = free_port()
    env = dict(os.environ)
    per_process = args.devices // args.processes
    env["XLA_FLAGS"] = (
        f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={per_process}".strip()
    )
    hosts, logs = [], []
    for i in range(args.processes):
        log = job.with_name(f"host{i}.log")
        logs.append(log)
        command = [sys.executable, __file__, "--host", str(i), "--job", str(job), "--port", str(port)]
        command += ["--processes", str(args.processes), "--devices", str(args.devices)]
        if args.diverge:
            command.append("--diverge")
        with open(log, "wb") as out:
            hosts.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + args.timeout
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # so `finally` runs
    try:
        return watch(hosts, logs, deadline, args.timeout)
    finally:  # also on Ctrl-C or SIGTERM: no host outlives the launcher
        for h in hosts:
            if h.poll() is None:
                h.kill()
            h.wait()
        signal.signal(signal.SIGTERM, before)


def watch(hosts: list[subprocess.Popen], logs: list[Path], deadline: float, timeout: float) -> str | None:
    """Stream host 0's log until every host exits 0 (None), one fails, or the deadline passes (why)."""
    with open(logs[0], "rb") as host0:
        while True:
            chunk = host0.read()
            if chunk:
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
            codes = [h.poll() for h in hosts]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i = failed[0]
                tail = logs[i].read_text(errors="replace").splitlines()[-HOST_LOG_TAIL:]
                return f"host {i} exited with status {codes[i]}; its last lines:\n" + "\n".join(tail)
            if all(c == 0 for c in codes):
                sys.stdout.write(host0.read().decode(errors="replace"))
                return None
            if time.monotonic() > deadline:
                running = [i for i, c in enumerate(codes) if c is None]
                return f"timed out after {timeout:.0f} s (see --timeout); hosts still running: {running}"
            time.sleep(0.2)


def compare_hosts(contexts, entries: list[dict], reports: list[dict]) -> tuple[int, int]:
    """Print each host's calls and compiles and, per model, every prompt's row: all hosts read the
    same tokens, equal to single-process L6 and HF (the tie rule applies). Returns (passed, total)."""
    from kvcourse.harness.compare import Row, compare, format_rows

    passed = total = 0
    for k, ((title, ctx), entry) in enumerate(zip(contexts, entries, strict=True)):
        for i, r in enumerate(reports):
            print(f"  host {i}: {r['models'][k]['calls']} jit calls, compiles {r['models'][k]['compiles']}")
        rows = []
        for i, prompt in enumerate(ctx.prompts):
            got = [r["models"][k]["tokens"][i] for r in reports]
            ref, agree = ctx.refs[i], all(g == got[0] for g in got)
            rows.append(
                Row(
                    label=prompt.label + ("" if agree else " (HOSTS DISAGREE)"),
                    vs_hf=compare(ref.tokens, got[0], ref),
                    vs_prev=compare(entry["l6"][i], got[0], ref),
                    text=ctx.tokenizer.decode(got[0]),
                    hf_text=ctx.tokenizer.decode(ref.tokens),
                )
            )
            passed += rows[-1].ok and agree
        print(f"-- {title}: every host's tokens, compared with single-process L6 and HF")
        print(format_rows(rows, "L6"))
        total += len(rows)
    return passed, total


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.host is not None:
        return host_main(args)

    from kvcourse.harness.smoke import prepare_models
    from L6_tpu_jax.engine import Engine

    with tempfile.TemporaryDirectory(prefix="kvcourse-multihost-") as work:
        try:
            check_args(args)
            contexts = prepare_models(
                args.model, args.prompts, args.max_new_tokens, Path(work) / "tiny-qwen3"
            )
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        entries = []
        for title, ctx in contexts:
            t0 = time.perf_counter()
            l6 = Engine(ctx.model_dir, max_model_len=ctx.max_model_len).generate(ctx.ids, ctx.max_new_tokens)
            print(f"== {title}: single-process L6 in {time.perf_counter() - t0:.1f} s ({ctx.model_dir})")
            entries.append(
                {
                    "title": title,
                    "model_dir": str(ctx.model_dir),
                    "ids": ctx.ids,
                    "max_new_tokens": ctx.max_new_tokens,
                    "max_model_len": ctx.max_model_len,
                    "l6": l6,
                }
            )
        job = Path(work) / "job.json"
        job.write_text(json.dumps({"models": entries}))
        print(
            f"-- starting {args.processes} host(s), {args.devices} device(s); host 0's log follows",
            flush=True,
        )
        problem = launch(args, job)
        demo_failures = 0
        if problem:
            print(f"!! {problem}")
            passed, total = 0, sum(len(ctx.ids) for _, ctx in contexts)
        else:
            reports = [json.loads(job.with_name(f"host{i}.json").read_text()) for i in range(args.processes)]
            demos = reports[0]["demos"]
            if demos:
                demo_failures = sum(not d["ok"] for d in demos)
                print(
                    f"divergence demonstrations: {len(demos) - demo_failures}/{len(demos)} behaved as the rules say"
                )
            passed, total = compare_hosts(contexts, entries, reports)
    print(
        f"L6 multi-host smoke: {passed}/{total} prompts match L6 and HF "
        f"({args.processes} processes, {args.devices} devices)"
    )
    return 0 if passed == total and not demo_failures else 1


if __name__ == "__main__":
    sys.exit(main())
