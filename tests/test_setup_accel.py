"""make setup ACCEL=cpu|cuda, without installing anything: what `make -n` would run, and the CUDA
requirements it would install (requirements.txt with its torch, jax and jaxlib pins replaced
by requirements-cuda.txt's). Whether the pins resolve is checked with `pip install --dry-run`
(README, "On a GPU"); a test cannot, offline."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def make_n(*args: str) -> subprocess.CompletedProcess:
    """``make -n setup ARGS`` in the repository: the commands make would run, none of them run."""
    return subprocess.run(  # -W: as if requirements.txt had changed, so the install shows, set up or not
        ["make", "-n", "-W", "requirements.txt", "setup", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )


def pins(lines: list[str]) -> dict[str, str]:
    """{package name: its requirement line} of a requirements file's lines, comments left out."""
    found = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if line:
            name = re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower()
            assert name not in found, f"{name} pinned twice"
            found[name] = line
    return found


def test_cuda_setup_installs_the_cuda_pins_in_place_of_the_cpu_ones(tmp_path):
    run = make_n("ACCEL=cuda")
    assert run.returncode == 0, run.stderr
    [merge] = [line for line in run.stdout.splitlines() if line.startswith("grep ")]
    assert "pip install -q -r .venv/requirements-cuda-all.txt" in run.stdout
    assert "touch .venv/.kvcourse-installed-cuda" in run.stdout
    merged = tmp_path / "all.txt"
    subprocess.run(
        merge.replace(".venv/requirements-cuda-all.txt", str(merged)), shell=True, cwd=ROOT, check=True
    )
    cpu, cuda = (
        pins((ROOT / "requirements.txt").read_text().splitlines()),
        pins(merged.read_text().splitlines()),
    )
    assert set(cuda) == set(cpu)  # every package once, none lost
    replaced = {name for name in cpu if cpu[name] != cuda[name]}
    assert replaced == {"torch", "jax"}  # jaxlib keeps its pin, and triton its (the one CUDA torch needs)
    assert cuda["torch"] == "torch===2.13.0" and cuda["jax"] == "jax[cuda13]==0.10.2"
    assert cuda["triton"].startswith("triton==3.7.1") and cpu["triton"] == cuda["triton"]


def test_cpu_setup_installs_requirements_txt_and_a_bad_accel_is_named():
    run = make_n("ACCEL=cpu")
    assert run.returncode == 0, run.stderr
    assert "pip install -q -r requirements.txt" in run.stdout and "cuda-all" not in run.stdout
    bad = make_n("ACCEL=rocm")
    assert bad.returncode == 2 and "ACCEL must be cpu or cuda, got 'rocm'" in bad.stderr
