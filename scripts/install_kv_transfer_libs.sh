#!/usr/bin/env bash
# Install the system libraries Mooncake's transfer engine loads (libibverbs, librdmacm), which
# prefill/decode disaggregation moves KV caches with; its Python package is in
# requirements/pins.txt. Idempotent: when both libraries are found it exits 0 without a word.
# Otherwise it installs Debian's packages with apt (needs root), pinned to the Debian 12
# versions the project was tested with; a pin the mirror no longer carries falls back, with a
# warning, to the mirror's current version.
set -euo pipefail

RDMA_CORE_VERSION=44.0-2

have() { ldconfig -p 2>/dev/null | grep -q "$1"; }

if have libibverbs.so.1 && have librdmacm.so.1; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "install_kv_transfer_libs.sh: libibverbs1 and librdmacm1 are missing and this is not" \
       "root: run 'sudo bash scripts/install_kv_transfer_libs.sh' (needed by rollout.prefill)" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
install() { apt-get install -y -qq --no-install-recommends "$@" >/dev/null; }
if ! install libibverbs1="$RDMA_CORE_VERSION" librdmacm1="$RDMA_CORE_VERSION"; then
  echo "install_kv_transfer_libs.sh: pinned versions unavailable; installing the mirror's" \
       "current ones" >&2
  install libibverbs1 librdmacm1
fi
