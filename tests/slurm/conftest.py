"""The session's one-node Slurm cluster (see cluster.py), started on first use."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .cluster import LocalSlurm


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    """A started LocalSlurm, stopped (and checked to leave nothing) at the end of the session."""
    with LocalSlurm(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster
