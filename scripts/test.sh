#!/usr/bin/env bash
# Set up (idempotently) and run the default test suite: unit tests plus real end-to-end tests
# (SGLang servers, Megatron-core over torchrun). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest "$@"
