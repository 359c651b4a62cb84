#!/usr/bin/env bash
# Builds a virtual environment once: by default .venv, with everything the demo, the examples
# and the tests need (the dev, hf, qlora and dali extras). `make bench` builds .venv-bench with the
# bench extra instead (VENV=.venv-bench EXTRAS=bench,dali): torchtune, the peer the
# benchmarks compare with, pins torchao below 0.10, which peft (LoRA, in the hf extra) refuses
# to import with, so it stays out of the environment people train in, and peft out of that one.
# A torch already on the machine (a CUDA build, say) is used as it is; with none, the CPU
# build 2.13.0 is installed first, so that no dependency pulls a multi-GB CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-dev,hf,qlora,dali}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "${PYTHON:-python3}" -m venv --system-site-packages "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: no torch found; installing torch==2.13.0 (CPU)"
  "$VENV/bin/pip" install -q torch==2.13.0 2> >(grep -v "is ignored: it is neither" >&2)
fi
if [[ ",$EXTRAS," != *,bench,* ]] && "$VENV/bin/python" - 2>/dev/null <<'PY'
import sys
from importlib.metadata import version

sys.exit(tuple(int(part) for part in version("torchao").split(".")[:2]) >= (0, 16))
PY
then  # an older setup installed the bench extra here
  echo "setup: removing torchtune and torchao<0.16 from $VENV (peft refuses that torchao; make bench has them)"
  "$VENV/bin/pip" uninstall -y -q torchtune torchao
fi
stamp="$VENV/.cswap-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$(cat "$stamp")" != "$EXTRAS" ]; then
  echo "setup: installing cswap-lightning and its $EXTRAS extras into $VENV"
  "$VENV/bin/pip" install -q -e ".[$EXTRAS]" 2> >(grep -v "is ignored: it is neither" >&2)
  echo "$EXTRAS" > "$stamp"
fi
