#!/usr/bin/env bash
# Wheels for an accelerator machine without network (docs/experiments.md#accelerator-benchmark):
# the packages its image lacks, for CPython 3.12 on manylinux x86_64, into wheels/ (git-ignored).
# The image has jax 0.11.2 + CUDA 13, numpy, numba, tensorstore, safetensors, tokenizers, jinja2,
# matplotlib, tqdm, PyYAML and older optax, orbax-checkpoint and flax. flax is 0.12.10 because
# 0.12.8 and 0.12.9 do not import on jax 0.11.2.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${1:-wheels}
mkdir -p "$DEST"
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary :all: --dest "$DEST" \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
    hydra-core==1.3.8 omegaconf==2.3.1 zstandard==0.25.0 gguf==0.19.0 tensorboardX==2.6.5 \
    optax==0.2.8 orbax-checkpoint==0.12.8 flax==0.12.10
# antlr4-python3-runtime (hydra's parser) is published only as an sdist: build its pure-Python wheel.
"$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$DEST" antlr4-python3-runtime==4.9.3
ls -l "$DEST"
