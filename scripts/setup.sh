#!/usr/bin/env bash
# Builds .venv once with everything the demo, the benchmarks and the tests need.
# A torch already on the machine (a CUDA build, say) is used as it is; with none, the CPU
# build 2.13.0 is installed first, so that no dependency pulls a multi-GB CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "${PYTHON:-python3}" -m venv --system-site-packages "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: no torch found; installing torch==2.13.0 (CPU)"
  "$VENV/bin/pip" install -q torch==2.13.0 2> >(grep -v "is ignored: it is neither" >&2)
fi
stamp="$VENV/.cswap-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing cswap-lightning and its dev, bench, hf and dali extras into $VENV"
  "$VENV/bin/pip" install -q -e ".[dev,bench,hf,dali]" 2> >(grep -v "is ignored: it is neither" >&2)
  touch "$stamp"
fi
