"""``builtin:code_tests``'s config: limits validated with the field named, and a machine that
cannot give the sandbox its namespaces refuses the source before any process starts (never
runs it unsandboxed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from relax_launch.config import ConfigError
from relax_launch.rl.config import RewardConfig
from relax_launch.rl.data_config import DataConfig
from relax_launch.rl.inputs import read_inputs

UID = 62000 + 100 * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
SOURCE = {"name": "code", "function": "builtin:code_tests"}


def reward(**code) -> RewardConfig:
    return RewardConfig(sources=[{**SOURCE, "code": {"uid": UID, **code}}])


@pytest.mark.parametrize(
    ("code", "field"),
    [
        ({"cpu_s": 0}, "cpu_s"),
        ({"memory_mb": 8}, "memory_mb"),
        ({"processes": 0}, "processes"),
        ({"disk_mb": 0}, "disk_mb"),
        ({"output_kb": 0}, "output_kb"),
        ({"concurrency": 0}, "concurrency"),
        ({"uid": 0}, "uid"),
        ({"code_pattern": "```python(.*"}, "code_pattern"),
        ({"code_pattern": "```python.*```"}, "code_pattern"),  # no group around the program
        ({"wall_s": 3}, "wall_s"),  # unknown: the wall time is the source's timeout_s
    ],
)
def test_a_bad_limit_is_refused_naming_its_field(code, field):
    with pytest.raises(ValidationError, match=field):
        reward(**code)


def test_code_belongs_to_builtin_code_tests_only():
    with pytest.raises(ValidationError, match="code is for builtin:code_tests only"):
        RewardConfig(sources=[{"name": "n", "function": "builtin:exact_numeric", "code": {}}])


def test_rows_without_tests_and_shared_uids_are_refused_before_any_process_starts(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "p", "tests": ["assert True"]}) + "\n")
    rows.write_text(rows.read_text() + json.dumps({"prompt": "q"}) + "\n")
    with pytest.raises(ConfigError, match=r"reward.sources\[0\].function: .* row 1 needs"):
        read_inputs(DataConfig(dataset=str(rows)), reward())
    two = RewardConfig(
        sources=[{**SOURCE, "code": {"uid": UID}}, {**SOURCE, "name": "b", "code": {"uid": UID}}]
    )
    with pytest.raises(ConfigError, match=r"reward.sources\[1\].code.uid: uid \d+ is also"):
        read_inputs(DataConfig(dataset="builtin:code"), two)


@pytest.mark.parametrize("code", [{}, {"code_pattern": "()"}], ids=["default", "own-pattern"])
def test_the_builtin_code_dataset_passes_the_checks(code):
    """The trial sandbox runs with the source's limits but its own program, whatever the
    source's code_pattern."""
    prompts = read_inputs(DataConfig(dataset="builtin:code"), reward(**code)).prompts
    assert len(prompts) == 1000 and all(len(p.meta["tests"]) == 3 for p in prompts)


CHECK = f"""
from relax_launch.config import ConfigError
from relax_launch.rl.config import RewardConfig
from relax_launch.rl.data_config import DataConfig
from relax_launch.rl.inputs import read_inputs
reward = RewardConfig(sources=[{{**{SOURCE!r}, "code": {{"uid": {UID}}}}}])
try:
    read_inputs(DataConfig(dataset="builtin:code"), reward)
except ConfigError as exc:
    print(exc)
"""


@pytest.mark.parametrize(
    ("setpriv", "cause"),
    [
        # root, but without CAP_SYS_ADMIN: unshare cannot make the namespaces
        (["--inh-caps=-sys_admin", "--bounding-set=-sys_admin"], "Operation not permitted"),
        # root without CAP_SETUID: the sandbox cannot switch to its unprivileged uid
        (["--inh-caps=-setuid", "--bounding-set=-setuid"], "PermissionError"),
    ],
    ids=["no-namespaces", "no-setuid"],
)
def test_a_machine_without_the_sandbox_refuses_the_source(setpriv, cause):
    if not os.path.exists("/usr/bin/setpriv") or os.geteuid() != 0:
        pytest.skip("needs root and util-linux's setpriv to take a capability away")
    done = subprocess.run(
        ["setpriv", *setpriv, sys.executable, "-c", CHECK],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("reward.sources[0].function: builtin:code_tests is refused")
    assert cause in done.stdout


def test_a_user_that_is_not_root_is_refused(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match="is refused: the code sandbox needs root"):
        read_inputs(DataConfig(dataset="builtin:code"), reward())
