#!/usr/bin/env bash
# Set up the opt-in virtualenv of rollout.environment (.venv-environments): verifiers and its
# dependencies at the versions in requirements/environments.txt, apart from the job's .venv
# (verifiers needs an openai that SGLang's pin excludes; docs/operations.md, "Environments").
# A job uses it with rollout.environment.python: .venv-environments/bin/python.
# Idempotent: a second run with unchanged pins exits at once.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv-environments}
PINS=requirements/environments.txt
STAMP=$VENV/.bootstrap-stamp
wanted=$(cat "$PINS" scripts/bootstrap_environments.sh | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$wanted" ]; then
  echo "bootstrap-environments: $VENV is up to date"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q \
  -r "$PINS" >"$VENV/bootstrap.log" 2>&1 || {
  echo "bootstrap-environments: pip FAILED; the end of $VENV/bootstrap.log:"
  tail -n 30 "$VENV/bootstrap.log" | sed 's/^/  | /'
  exit 1
}
"$VENV/bin/python" -c "import openai, verifiers"
echo "$wanted" >"$STAMP"
echo "bootstrap-environments: $VENV ready (rollout.environment.python: $VENV/bin/python)"
