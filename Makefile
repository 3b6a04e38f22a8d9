# ito-training: `make demo` runs the main job on embedded infra; `make test` runs the whole suite.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install sysdeps demo desk screenshots lint test suite-times bench chaos up down clean

install: $(STAMP)

# torch first, from the CPU wheel, pinned exactly (a range would pull a multi-GB CUDA build).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

# chromium and tmux for the browser and terminal tests, as root on Debian when missing.
sysdeps:
	bash .ci/system-deps

# DEMO_ARGS=--keep leaves the stack and the desk's dashboard up at the end (`make down` stops them);
# DEMO_ARGS=--finetune also fine-tunes a tiny HF base model on chat JSONL and exports it.
DEMO_ARGS ?=
demo: install
	PATH="$(abspath $(VENV))/bin:$$PATH" bash examples/demo.sh $(DEMO_ARGS)

# The README's screenshots of the desk, taken by the browser test's own code path.
screenshots: install sysdeps
	ITO_SCREENSHOT_DIR="$(abspath docs/screenshots)" PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pytest -q tests/e2e/test_desk_browser.py

# The desk's dashboard in the foreground, on a stack `make up` started (`up --desk` starts it too).
desk: install
	$(VENV)/bin/ito-training desk serve

# Lint, format check and type check (config in pyproject.toml); `make test` runs them first.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Two workers side by side (pytest-xdist): most e2e time is waiting on stacks. The timed fault
# scenarios form one group that one worker runs in turn, and a module whose fixture is
# expensive (a stack, the quick bench) stays on one worker (tests/conftest.py). Each worker, and what
# it starts, trains on its share of the cores (OMP_NUM_THREADS: tests/support.py THREADS). One process:
# `make test PYTEST_ARGS=`. The long fault scenarios are `make chaos`'s (marker `chaos`).
PYTEST_ARGS ?= -n 2 --dist loadgroup
test: install sysdeps lint
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pytest $(PYTEST_ARGS)

# The suite as `make test` runs it, each test's time recorded: per-worker busy time, the slowest
# tests and files (bench/suite_times.py; figures in bench/suite-times/summary.json).
suite-times: install sysdeps
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m bench.suite_times -- $(PYTEST_ARGS)

# Writes bench/results.json and prints a table; `make bench BENCH_ARGS=--quick` runs tiny sizes.
BENCH_ARGS ?=
bench: install
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m bench.run $(BENCH_ARGS)

# Fault scenarios (trainer/scheduler SIGKILL, NATS/Redis restarts) on embedded infra -> a table;
# then the suite's long fault tests (marker `chaos`), whole.
chaos: install
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m chaos.scenarios
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pytest -m chaos

# ITO_CLUSTER=1 (here and for `make demo`): a 3-node NATS cluster and two instances of every service.
up: install
	$(VENV)/bin/ito-training up --detach $(if $(filter 1,$(ITO_CLUSTER)),--cluster)

down:
	$(VENV)/bin/ito-training down

clean:
	rm -rf .ito

# GPU throughput and MFU (bench/gpu.py): 150M and 1B in bf16 on one GPU -> bench/gpu_results.json.
# GPU_BENCH_ARGS=--fsdp for FSDP2 over every GPU, --dry-run for the CPU check. The venv holds the
# CPU wheel of torch: on a GPU host set GPU_PY to a Python whose torch sees CUDA (and has msgspec).
GPU_PY ?= $(PY)
GPU_BENCH_ARGS ?=
.PHONY: gpu-bench
gpu-bench:
	$(GPU_PY) -m bench.gpu $(GPU_BENCH_ARGS)
