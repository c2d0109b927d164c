"""The sandboxes of ``builtin:code_tests``: each sample's program runs against its row's tests
in a sandbox of its own (``rl/sandbox_init.py``: namespaces without network, a read-only
filesystem but a small tmpfs, limits, an unprivileged uid), ``concurrency`` at once, several
callers' batches sharing them (``rl/pool_batches.py``). Rank 0 waits on their result pipes with
``select`` (the GIL released: the gateway's and the other threads' work goes on), bounded by
the earliest wall-time deadline in flight; a sandbox over
``timeout_s`` is killed by PID and process group (its PID namespace dies with it) and keeps
the tests it passed before. Reward = tests passed / tests."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_launch.config.patterns import last_group
from relax_launch.deadline import Deadline, wait_until
from relax_launch.processes import group_alive
from relax_launch.rl.code_config import CODE_PATTERN, CodeTestsConfig
from relax_launch.rl.pool_batches import Batch, BatchQueue, Outcome

INIT = Path(__file__).with_name("sandbox_init.py")
NAMESPACES = ["--net", "--pid", "--mount-proc", "--fork", "--kill-child"]
RESULT_BYTES = 1 << 20  # what a sandbox may send back; past it the rest is not read
STOP_TIMEOUT_S = 10.0  # a killed namespace is gone in milliseconds


def tests_problem(tests: Any) -> str | None:
    """What is wrong with a row's ``tests``; None when they can run."""
    if not isinstance(tests, list | tuple) or not tests:
        return "needs a non-empty 'tests' list (assert statements or {input, output} objects)"
    for number, test in enumerate(tests):
        io_test = isinstance(test, dict) and isinstance(test.get("output"), str)
        if not (isinstance(test, str) or io_test) or (io_test and set(test) - {"input", "output"}):
            return f"tests[{number}] is neither a string nor an {{input, output}} object"
    return None


@dataclass
class Sandbox:
    """One running sandbox and what it reported so far."""

    batch: Batch
    index: int
    tests: int
    slot: int
    process: subprocess.Popen
    fd: int
    workdir: Path
    deadline: Deadline
    buffer: bytearray = field(default_factory=bytearray)
    passed: set[int] = field(default_factory=set)
    error: str | None = None
    log: str = ""  # the end of unshare's and the init's stderr

    def read(self) -> bool:
        """Take what arrived; False once every holder of the pipe closed it (it ended)."""
        try:
            chunk = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return True
        if len(self.buffer) < RESULT_BYTES:
            self.buffer += chunk
        *lines, rest = self.buffer.split(b"\n")
        self.buffer = bytearray(rest)
        for line in lines:
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                result = json.loads(line)
                self.error = self.error or result.get("error")
                if result.get("passed") is True and 0 <= result["test"] < self.tests:
                    self.passed.add(result["test"])
        return chunk != b""

    def stop(self) -> None:
        """SIGKILL ``unshare`` and its process group (its ``--kill-child`` takes the PID
        namespace down), reap it, remove its directory. The namespace's init, in the group,
        dies only once the kernel has killed every process of its namespace: the wait for the
        group is the wait for the whole sandbox."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=STOP_TIMEOUT_S)
        if wait_until(lambda: not group_alive(self.process.pid), STOP_TIMEOUT_S, 0.01) is None:
            raise RuntimeError(  # its uid's processes would count against the next sample's
                f"sandbox {self.process.pid} outlived SIGKILL for {STOP_TIMEOUT_S:.0f} s"
            )
        with contextlib.suppress(OSError):
            self.log = (self.workdir / "stderr").read_bytes()[-2000:].decode(errors="replace")
        os.close(self.fd)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def outcome(self, timed_out: bool) -> Outcome:
        # its init exits 0 whatever the program did; else the sandbox itself failed
        if not timed_out and self.error is None and self.process.returncode != 0:
            self.error = f"the sandbox exited with {self.process.returncode}: {self.log.strip()}"
        if self.error is not None:
            return Outcome(error=f"builtin:code_tests: {self.error}")
        return Outcome(value=len(self.passed) / self.tests, timed_out=timed_out)


class CodeSandboxPool:
    """Runs ``("code_tests", (response, tests))`` calls, ``config.concurrency`` at once; the
    same ``run`` as ``rl/reward_pool.ScoringPool``. ``scratch``: where each sandbox's job file
    and log are written (removed with the sandbox)."""

    def __init__(self, config: CodeTestsConfig, scratch: str | None = None) -> None:
        self.config = config
        self.scratch = scratch or tempfile.gettempdir()
        self.queue = BatchQueue("the code sandboxes")
        self.free = deque(range(config.concurrency))  # the slots (uids) no sandbox runs as
        self.running: list[Sandbox] = []
        self.closed = False

    def run(self, calls: list[tuple[str, tuple]], timeout_s: float) -> list[Outcome]:
        """Each call's outcome, in order; each sandbox ends within ``timeout_s`` of its start."""
        batch = Batch([Outcome() for _ in calls], timeout_s)
        for index, (_, (response, tests)) in enumerate(calls):
            source = last_group(response, self.config.code_pattern)
            if problem := tests_problem(tests):
                batch.outcomes[index].error = f"builtin:code_tests: the row {problem}"
            elif source is None:
                batch.outcomes[index].value = 0.0  # no program in the response
            else:
                batch.pending.append((index, (source, list(tests))))
        return self.queue.serve(batch, self._round, self._abandon)

    def _round(self) -> None:
        """Start what the free slots take, wait for a result or a deadline, end the sandboxes
        that ended, passed their limit or whose caller is gone."""
        if self.closed:
            for sandbox in list(self.running):
                self._end(sandbox, timed_out=False)
            raise RuntimeError("the code sandboxes are closed")
        while self.free and (job := self.queue.take()) is not None:
            batch, index, (source, tests) = job
            slot = self.free.popleft()
            try:
                self.running.append(
                    self._start((batch, index), source, tests, slot, batch.timeout_s)
                )
            except BaseException:
                self.free.appendleft(slot)
                self.queue.done(batch, index, Outcome(error="builtin:code_tests: no sandbox"))
                raise
        left = min((s.deadline.left() for s in self.running), default=0.0)
        select.select([self.queue.wake_fd, *(s.fd for s in self.running)], [], [], left)
        self.queue.drain()
        for sandbox in list(self.running):
            ended = not sandbox.read()
            if ended or sandbox.deadline.passed or sandbox.batch.abandoned:
                self._end(sandbox, timed_out=not ended)

    def _end(self, sandbox: Sandbox, timed_out: bool) -> None:
        self.running.remove(sandbox)
        try:
            sandbox.stop()
        finally:
            self.free.append(sandbox.slot)
            self.queue.done(sandbox.batch, sandbox.index, sandbox.outcome(timed_out))

    def _abandon(self, batch: Batch) -> None:
        for sandbox in [s for s in self.running if s.batch is batch]:
            self._end(sandbox, timed_out=False)

    def _start(
        self, call: tuple[Batch, int], source: str, tests: list, slot: int, timeout_s: float
    ) -> Sandbox:
        """A sandbox for ``call`` (its batch, its index there), as uid ``config.uid +
        slot``, to end within ``timeout_s``."""
        limits = self.config
        workdir = Path(tempfile.mkdtemp(prefix="relax-code-", dir=self.scratch))
        job = {
            "source": source,
            "tests": tests,
            "uid": limits.uid + slot,
            "cpu_s": limits.cpu_s,
            "memory_mb": limits.memory_mb,
            "disk_mb": limits.disk_mb,
            "processes": limits.processes,
            "output_bytes": limits.output_kb * 1024,
            "wall_s": timeout_s,
        }
        read_end, write_end = os.pipe()
        job["results_fd"] = write_end  # the same number in the sandbox (pass_fds)
        (workdir / "job.json").write_text(json.dumps(job))
        command = ["unshare", *NAMESPACES, "--", sys.executable, "-I", "-S", "-B", str(INIT)]
        try:
            with open(workdir / "stderr", "wb") as log:
                process = subprocess.Popen(
                    [*command, str(workdir / "job.json")],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                    pass_fds=(write_end,),
                    start_new_session=True,  # its own process group, killed as one
                )
        except OSError:
            os.close(read_end)
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        finally:
            os.close(write_end)
        os.set_blocking(read_end, False)
        deadline = Deadline(timeout_s)
        return Sandbox(*call, len(tests), slot, process, read_end, workdir, deadline)

    def close(self) -> None:
        """Stop taking calls; a caller still running gets a RuntimeError and the sandboxes
        are killed: by the caller running the rounds, else here (an interrupted caller's
        left with no one running them)."""
        self.closed = True
        self.queue.close()


def sandbox_problem(config: CodeTestsConfig) -> str | None:
    """Why this machine cannot run the sandbox (namespaces, uids), by starting one; None when
    it can."""
    if os.geteuid() != 0:
        return (
            "the code sandbox needs root (CAP_SYS_ADMIN for its network, PID and mount "
            "namespaces, CAP_SETUID for its uids); run the job as root or in a container "
            "that grants them"
        )
    if shutil.which("unshare") is None:
        return "the code sandbox needs util-linux's unshare on PATH"
    for uid in range(config.uid, config.uid + config.concurrency):
        with contextlib.suppress(KeyError):
            return f"uid {uid} belongs to the account {pwd.getpwuid(uid).pw_name}; set code.uid"
    call = ("code_tests", ("```python\nimport json\nx = json.loads('1')\n```", ["assert x == 1"]))
    pool = CodeSandboxPool(config.model_copy(update={"code_pattern": CODE_PATTERN}))
    try:  # the trial's pool: the job's own limits
        (outcome,) = pool.run([call], timeout_s=30)
    except OSError as exc:
        return f"the code sandbox could not start: {exc}"
    finally:
        pool.close()
    if outcome.value != 1.0:
        return f"a trial sandbox failed: {outcome.error or f'reward {outcome.value}'}"
    return None
