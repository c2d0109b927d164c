#!/usr/bin/env bash
# Download, here (with network), the few wheels the GPU check needs on a GPU machine that has its
# own torch but no network and no project environment (one GPU, Python 3.12: the machine this
# workplace lends for checks). They go to .whl/ (ignored by git), about 20 MB; carry that folder
# to the machine and run scripts/gpu_check.sh there. Versions are the project's pins.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${GPU_PYTHON_VERSION:-3.12}
WANTED=(megatron-core pydantic pydantic_core annotated-types typing-inspection orjson)
mkdir -p .whl
for name in "${WANTED[@]}"; do
  pin=$(grep -i "^${name}==" requirements/pins.txt) || { echo "gpu_wheels: $name is not pinned" >&2; exit 1; }
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any -d .whl "$pin"
done
du -sh .whl
