"""The sandbox's first process: ``unshare --net --pid --mount-proc --fork --kill-child --
python -I -S sandbox_init.py JOB.json``, started by ``rl/code_pool.py`` as root. It is PID 1 of
a PID namespace of its own, in a network namespace with only a loopback that is down and a
mount namespace of its own, where it:
  - remounts every mount read-only, then mounts a tmpfs of ``disk_mb`` at /tmp: the only
    writable place, gone with the namespace (a fresh /proc shows only the sandbox's processes);
    where the interpreter's standard library lies under a directory closed to other users
    (pyenv's under /root), a tmpfs hides that directory with only the library bound back in;
  - forks the test runner (``rl/sandbox_tests.py``), which sets its limits (CPU seconds, address
    space, file size, processes, open files, no core), drops every group and switches to the
    job's unprivileged uid and gid, and runs the tests from /tmp;
  - waits for it, at most ``wall_s`` + 1 s (its own alarm: the sandbox ends even if the job
    that started it died), then exits. When PID 1 of a PID namespace exits, the kernel kills
    every process left in it: nothing the candidate forked or detached outlives the sandbox.
The job kills the sandbox at ``wall_s`` by killing ``unshare``, whose ``--kill-child`` kills
this process. Results and errors (``{"error": ...}``) go to the job's pipe, ``results_fd``."""

from __future__ import annotations

import ctypes
import json
import math
import os
import resource
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path under python -I
from relax_launch.rl.sandbox_tests import run_tests  # noqa: E402 - after the path above

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 32, 4096, 16384
LIBC = ctypes.CDLL(None, use_errno=True)


def mount(source: str | None, target: str, kind: str | None, flags: int, data: str = "") -> None:
    args = [s.encode() if s is not None else None for s in (source, target, kind, data)]
    if LIBC.mount(args[0], args[1], args[2], flags, args[3]) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {target}: {os.strerror(errno)}")


def mount_points() -> list[str]:
    """Every mount point this namespace sees, parents before children."""
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    points = {line.split()[4].encode().decode("unicode_escape") for line in lines}
    return sorted(points, key=lambda p: p.count("/"))


def closed_ancestor(path: Path) -> Path | None:
    """The first directory on the way to ``path`` that other users cannot enter."""
    for directory in [*reversed(path.parents), path]:
        if not directory.stat().st_mode & 0o001:
            return directory
    return None


def expose_python() -> None:
    """The interpreter's standard library, readable by the sandbox's uid where it lies under a
    directory closed to others (pyenv's under /root): a tmpfs hides that directory, and the
    library's directory is bound back at its own path inside it."""
    prefix = Path(sys.base_prefix)
    closed = closed_ancestor(prefix)
    if closed is None:
        return
    handle = os.open(prefix, os.O_PATH | os.O_DIRECTORY)  # reaches it once the tmpfs hides it
    mount("tmpfs", str(closed), "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    prefix.mkdir(mode=0o755, parents=True, exist_ok=True)
    mount(f"/proc/self/fd/{handle}", str(prefix), None, MS_BIND | MS_REC)
    os.close(handle)


def seal_filesystem(job: dict) -> None:
    """Every mount read-only (the root must be; a mount that refuses, such as a bind of a
    special file, is left as it is: the uid's permissions still hold there), then the tmpfs."""
    expose_python()
    for point in mount_points():
        try:
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
        except OSError:
            if point == "/":
                raise
    size = f"size={job['disk_mb']}m,nr_inodes=4096,mode=0700,uid={job['uid']},gid={job['uid']}"
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, size)


def limit_and_drop(job: dict) -> None:
    """The runner's limits, then its uid; a limit it cannot raise back once it is not root."""
    cpu = math.ceil(job["cpu_s"])
    limits = {
        resource.RLIMIT_CPU: (cpu, cpu + 1),  # SIGXCPU at the soft limit ends the runner
        resource.RLIMIT_AS: (job["memory_mb"] << 20,) * 2,
        resource.RLIMIT_FSIZE: (job["disk_mb"] << 20,) * 2,
        resource.RLIMIT_NPROC: (job["processes"],) * 2,  # counted per uid: one uid a sandbox
        resource.RLIMIT_NOFILE: (64, 64),
        resource.RLIMIT_CORE: (0, 0),
    }
    for kind, value in limits.items():
        resource.setrlimit(kind, value)
    os.setgroups([])
    os.setgid(job["uid"])
    os.setuid(job["uid"])
    os.chdir("/tmp")
    os.environ.clear()
    os.environ.update(HOME="/tmp", PATH="/usr/bin:/bin", LANG="C.UTF-8")


def runner(job: dict) -> None:
    """The forked test runner: never returns."""
    try:
        limit_and_drop(job)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # what the candidate writes around sys.stdout reaches no one
            os.dup2(devnull, fd)
        run_tests(job["source"], job["tests"], job["output_bytes"], job["results_fd"])
    except BaseException as exc:  # noqa: BLE001 - reported, then this process ends
        report_error(job, f"the test runner failed: {type(exc).__name__}: {exc}")
    os._exit(0)


def report_error(job: dict, message: str) -> None:
    os.write(job["results_fd"], (json.dumps({"error": message}) + "\n").encode())


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    # PID 1 of a namespace ignores signals it has no handler for, the alarm's included
    signal.signal(signal.SIGALRM, lambda *_: os._exit(124))
    signal.alarm(math.ceil(job["wall_s"]) + 1)
    try:
        seal_filesystem(job)
    except OSError as exc:
        report_error(job, f"the sandbox could not seal its filesystem: {exc}")
        sys.exit(1)
    child = os.fork()
    if child == 0:
        runner(job)
    os.waitpid(child, 0)


if __name__ == "__main__":
    main()
