"""``relax_launch.processes`` against real processes: a PID and a process group that run, then
do not (a zombie counts as gone)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

from relax_launch.deadline import wait_until
from relax_launch.processes import group_alive, running

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_group_is_alive_while_any_member_runs():
    # a group leader that starts a child and exits: the group lives on in the child
    code = f"import subprocess; subprocess.Popen({SLEEPER!r})"
    leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        leader.wait(timeout=30)  # reaped: only the child is left in the group
        assert not running(leader.pid)
        assert group_alive(leader.pid)
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
    assert wait_until(lambda: not group_alive(leader.pid), 10, 0.05)


def test_an_unreaped_child_and_its_group_are_gone():
    child = subprocess.Popen(SLEEPER, start_new_session=True)
    try:
        assert running(child.pid) and group_alive(child.pid)
        child.kill()  # not reaped yet: a zombie
        zombie = wait_until(lambda: psutil.Process(child.pid).status() == "zombie", 10, 0.02)
        assert zombie
        assert not running(child.pid) and not group_alive(child.pid)
    finally:
        child.kill()
        child.wait()
