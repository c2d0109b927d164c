#!/usr/bin/env bash
# Install Debian's Slurm (slurmctld, slurmd, the client commands) and MUNGE, for the one-node
# test cluster of tests/slurm/cluster.py. Idempotent: when slurmctld, slurmd, sbatch and munged
# are all found (on PATH or in /usr/sbin) it exits 0 without a word. Otherwise it installs the
# packages with apt (needs root), pinned to the Debian 12 versions the harness was written
# against. A pin the mirror no longer carries (a point release replaced it) falls back, with a
# warning, to the mirror's current version.
set -euo pipefail

SLURM_VERSION=22.05.8-4+deb12u3
MUNGE_VERSION=0.5.15-2+deb12u1

have() { PATH="$PATH:/usr/sbin:/sbin" command -v "$1" >/dev/null 2>&1; }

if have slurmctld && have slurmd && have sbatch && have munged; then
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq

pinned=(slurmctld="$SLURM_VERSION" slurmd="$SLURM_VERSION" slurm-client="$SLURM_VERSION"
        munge="$MUNGE_VERSION")
install() { apt-get install -y -qq --no-install-recommends "$@" >/dev/null; }

if ! install "${pinned[@]}"; then
  echo "install_slurm.sh: pinned versions unavailable; installing the mirror's current ones" >&2
  install slurmctld slurmd slurm-client munge
fi
