#!/usr/bin/env bash
# benchmarks/accelerator.py on an accelerator machine without network, set up as
# docs/experiments.md#accelerator-benchmark says: the image's python3 (jax 0.11.2 with CUDA 13)
# plus the wheels scripts/accelerator_wheels.sh put in the git-ignored wheels/ folder (carry it
# with the working tree), installed into /tmp/site. Arguments go to the benchmark (e.g. --quick).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
WHEELS=${WHEELS:-wheels}
if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "no wheels in $WHEELS/: run scripts/accelerator_wheels.sh on a machine with network first" >&2
    exit 1
fi
"$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --upgrade --target "$SITE" "$WHEELS"/*.whl
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import jax, flax, optax, orbax.checkpoint, hydra, zstandard, gguf, tensorboardX
print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, jax.devices())'
exec "$PY" benchmarks/accelerator.py "$@"
