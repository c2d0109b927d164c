"""Run one of these tests' torchrun worker scripts on CPU ranks of this machine."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from harness.processes import run_group

from relax_launch.inference.process import free_port

# a hang guard only: the memory test's student job took past 300 s on a loaded AVX2-only host
TIMEOUT_S = 900


def run_worker(worker: Path, ranks: int, args: list[str], env: dict[str, str]) -> list[dict]:
    """Run ``worker`` with ``ranks`` torchrun ranks; the JSON lines it printed, rank by rank. A
    non-zero exit fails the test with the worker's stderr.

    Each rank's stdout goes to a file of its own (torchrun's ``--redirects 1``): ranks printing
    reports of more than a pipe's atomic write (4 KiB) to one shared pipe interleaved them on a
    loaded machine."""
    torchrun = Path(sys.executable).with_name("torchrun")
    with tempfile.TemporaryDirectory(prefix="torchrun-worker-") as log_dir:
        command = [str(torchrun), "--nproc-per-node", str(ranks), "--master-port", str(free_port())]
        command += ["--log-dir", log_dir, "--redirects", "1", str(worker), *map(str, args)]
        run_group(command, TIMEOUT_S, env)
        outputs = sorted(Path(log_dir).glob("**/attempt_*/*/stdout.log"), key=_local_rank)
        assert len(outputs) == ranks, f"expected {ranks} ranks' stdout, found {outputs}"
        lines = [line for out in outputs for line in out.read_text().splitlines()]
    return [json.loads(line) for line in lines if line.startswith("{")]


def _local_rank(stdout_log: Path) -> int:
    return int(stdout_log.parent.name)
