#!/usr/bin/env bash
# Builds .venv-oldest with the oldest release of each dependency that pyproject.toml allows
# (each `>=` floor pinned exactly; the dev, hf and dali extras too) and runs the suite without
# the slow tests there: what the floors promise, checked. Not part of CI: torch's floor has no CPU
# wheel on PyPI, so this downloads its CUDA build (about 3 GB).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-oldest}
if [ ! -x "$VENV/bin/python" ]; then
  echo "oldest: creating $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
pins=$("$VENV/bin/python" - <<'PY'
import re
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
for requirement in (*project["dependencies"], *extras["dev"], *extras["hf"], *extras["dali"]):
    print(re.sub(r">=", "==", requirement))
PY
)
echo "oldest: installing $(echo "$pins" | tr '\n' ' ')"
mapfile -t requirements <<< "$pins"
"$VENV/bin/pip" install -q "${requirements[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
"$VENV/bin/pip" install -q --no-deps -e . 2> >(grep -v "is ignored: it is neither" >&2)
"$VENV/bin/python" -m pytest -q -m "not slow" "$@"
