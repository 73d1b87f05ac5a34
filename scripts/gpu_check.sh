#!/usr/bin/env bash
# Validates and benchmarks the GPU half on a CUDA machine, offline, in one command, and
# writes bench/results/gpu-report.md: the compiled tests beside a short run of the trainer (killed
# and resumed), the probe's train steps of Qwen3-1.7B, then the loss-step benchmarks.
# --time-limit SECONDS shares a short lease among them (the stages that do not fit are
# listed as not run); --skip-tests, --skip-trainer, --skip-probe, --skip-bench leave one out.
#
#   bash scripts/gpu_check.sh                 # install, test (compiled Triton), benchmark
#   WHEELS=/path/to/wheels bash scripts/gpu_check.sh   # peers' wheels (Liger, CCE, TRL, DeepSpeed), no index
#   bash scripts/gpu_check.sh --dry-run       # the CPU, interpreter, tiny shapes (CI)
#
# The project goes into the Python that runs this script with --no-deps, so the torch
# and Triton already installed there are the ones tested; the trainer and the probe also
# need transformers and deepspeed there. Exits non-zero if any correctness test failed, a
# section crashed or a run failed. Other flags go to bench/gpu_check.py (--help).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-$ROOT/.whl}"
cd "$ROOT"

if [[ " $* " != *" --dry-run "* ]]; then
    echo "gpu_check: installing hadw-kernels (no dependencies: torch and Triton stay as they are)" >&2
    if ! HADW_BUILD_CPP=0 "$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index -e "$ROOT"; then
        echo "gpu_check: pip could not install the project here; running it from the source tree" >&2
        export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    fi
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        echo "gpu_check: installing the peers' wheels from $WHEELS" >&2
        "$PYTHON" -m pip install -q --no-deps --no-index "$WHEELS"/*.whl
    fi
fi
exec "$PYTHON" "$ROOT/bench/gpu_check.py" "$@"
