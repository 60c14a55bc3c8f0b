# Two commands a user needs: `make train` and `make test`. Both create .venv from the
# pinned lock file on first use, so a fresh machine needs only python3 and pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Simulated CPU devices so sharded code paths run on a laptop; harmless on accelerators.
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

.PHONY: train test test-slow bench clean-venv

$(STAMP): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

train: $(STAMP)
	$(PY) scripts/train.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/inner_step.py $(ARGS)

clean-venv:
	rm -rf $(VENV)
