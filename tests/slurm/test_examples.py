"""The scripts in slurm/ are what ``relax-launch sbatch --dry-run`` renders today."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_launch.commands.sbatch import render_examples

ROOT = Path(__file__).resolve().parents[2]


def test_slurm_scripts_are_current_renderings(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(ROOT)  # the examples name their configs from the repository's root
    rendered = render_examples()
    on_disk = {p.name: p.read_text() for p in (ROOT / "slurm").glob("*.sbatch")}
    assert on_disk == rendered, "regenerate them: python -m relax_launch.commands.sbatch"
