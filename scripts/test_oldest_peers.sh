#!/usr/bin/env bash
# The integrations' tests against the oldest TRL release they support (the newest is what
# .venv holds, and the README's test command runs it). verl's supported range has one
# release, which .venv holds. The older TRL is put in front of .venv's through PYTHONPATH
# (its own dependencies are .venv's), so nothing in .venv changes:
#
#   bash scripts/test_oldest_peers.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="$ROOT/.venv/bin/python"
OLDEST_TRL="$("$PYTHON" -c 'from hadw_kernels.integrations.versions import SUPPORTED; print(SUPPORTED["trl"].split(",")[0].lstrip(">="))')"
TARGET="${TMPDIR:-/tmp}/hadw-oldest-trl-$OLDEST_TRL"
if [ ! -d "$TARGET/trl" ]; then
    "$PYTHON" -m pip install -q --no-deps --target "$TARGET" "trl==$OLDEST_TRL"
fi
cd "$ROOT"
PYTHONPATH="$TARGET" "$PYTHON" -c "import trl; assert trl.__version__.startswith('$OLDEST_TRL'), trl.__version__; print('testing against trl', trl.__version__)"
PYTHONPATH="$TARGET" "$PYTHON" -m pytest -q tests/test_integration_trl.py
