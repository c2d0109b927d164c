"""Run one of these tests' torchrun worker scripts on CPU ranks of this machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from relax_launch.inference.process import free_port


def run_worker(worker: Path, ranks: int, args: list[str], env: dict[str, str]) -> list[dict]:
    """Run ``worker`` with ``ranks`` torchrun ranks; the JSON lines it printed. A non-zero exit
    fails the test with the worker's stderr."""
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [str(torchrun), "--nproc-per-node", str(ranks), "--master-port", str(free_port())]
        + [str(worker), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
