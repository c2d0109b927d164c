"""Which live processes a test started: each test's processes inherit a tag in their
environment (set by the ``no_process_outlives_the_test`` fixture), orphans included."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import psutil

TEST_TAG = "RELAX_TEST_PROCESS_TAG"  # inherited by every process a test starts


def processes_tagged(tag: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``tag`` (orphans included: they keep it)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            if process.environ().get(TEST_TAG) == tag:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def seconds_until_gone(tag: str, since: float, limit_s: float = 90) -> float:
    """Seconds from ``since`` (``time.monotonic``) until no process tagged ``tag`` is left;
    fails naming what is left after ``limit_s``."""
    while processes_tagged(tag) and time.monotonic() - since < limit_s:
        time.sleep(0.1)
    left = [" ".join(p.cmdline())[:80] for p in processes_tagged(tag)]
    assert not left, f"left after {limit_s} s: {left}"
    return time.monotonic() - since


def run_group(command: list[str], timeout_s: float, env: dict[str, str]) -> str:
    """Run ``command`` in a process group of its own; its stderr. Past ``timeout_s`` (or
    interrupted) it and every process under it are killed: killing torchrun alone leaves its
    ranks (each in a session of its own) running, orphaned and untagged when a module fixture
    started them, for the rest of the test run."""
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        _, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_tree(process)
        _, stderr = process.communicate()
        raise AssertionError(f"{command[:2]} ran past {timeout_s} s: {stderr[-4000:]}") from None
    finally:
        if process.poll() is None:
            _kill_tree(process)
            process.wait()
    assert process.returncode == 0, stderr[-4000:]
    return stderr


def _kill_tree(process: subprocess.Popen) -> None:
    """Kill ``process``, its group and every descendant by PID: torchrun starts each rank in a
    session of its own, out of torchrun's group."""
    try:
        tree = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    os.killpg(process.pid, signal.SIGKILL)
    for child in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
