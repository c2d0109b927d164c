"""``run_group``: a command run past its limit takes its whole process group with it (as
torchrun's ranks must go with torchrun)."""

from __future__ import annotations

import os
import sys

import pytest
from harness.processes import run_group

from relax_launch.deadline import wait_until
from relax_launch.processes import running


def test_a_command_past_its_limit_takes_its_children_with_it(tmp_path):
    pid_file = tmp_path / "child.pid"
    # a parent that starts a child in a session of its own (writing its PID) and waits on it:
    # torchrun and a rank
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen(\n"
        "    [sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True\n"
        ")\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "child.wait()\n"
    )
    with pytest.raises(AssertionError, match="ran past 10 s"):
        run_group([sys.executable, "-c", code], 10, dict(os.environ))
    child = int(pid_file.read_text())
    assert wait_until(lambda: not running(child), 10, 0.05), "the child outlived its parent"


def test_a_failing_command_fails_with_its_stderr():
    code = "import sys; sys.exit('the reason')"
    with pytest.raises(AssertionError, match="the reason"):
        run_group([sys.executable, "-c", code], 60, dict(os.environ))
