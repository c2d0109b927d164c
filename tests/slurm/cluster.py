"""A real one-node Slurm cluster for tests, started and stopped by the test session itself.

Code that submits, watches and cancels Slurm jobs is only worth testing against a real
slurmctld and slurmd: a fake would agree with whatever we believe Slurm does. The test
machines run no systemd, so nothing starts the daemons for us. ``LocalSlurm`` installs
Debian's packages when they are missing (scripts/install_slurm.sh), writes a slurm.conf into a
directory of its own (free ports, state, spool, logs and pid files all in there, so parallel
runs do not collide), starts munged (only when none runs), slurmctld and slurmd, and waits
until the node is idle. On exit it stops, by PID, exactly the daemons it started and checks
that none of them, and no job process of its cluster, is left.
"""

from __future__ import annotations

import os
import re
import shutil
import signal as signals
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import psutil

from relax_launch.inference.process import free_port

REPO = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = REPO / "scripts/install_slurm.sh"
SBIN_PATH = "/usr/sbin:/sbin"
MUNGE_RUN = Path("/run/munge")
MUNGE_PID_FILE = MUNGE_RUN / "munged.pid"
INSTALL_TIMEOUT_S = 900.0
COMMAND_TIMEOUT_S = 30.0
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.5
KILL_WAIT_S = 30  # slurm.conf KillWait: SIGTERM to SIGKILL of a cancelled job
FINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL"}
    | {"DEADLINE", "OUT_OF_MEMORY"}
)


def executable(name: str) -> str | None:
    """``name`` on PATH, else in /usr/sbin or /sbin (often not on a non-login root's PATH)."""
    return shutil.which(name) or shutil.which(name, path=SBIN_PATH)


def run(
    args: list[str],
    env: dict[str, str] | None = None,
    timeout: float = COMMAND_TIMEOUT_S,
    cwd: Path | None = None,
) -> str:
    """Runs a command to completion (bounded); its stdout, or an error that shows its stderr."""
    try:
        done = subprocess.run(
            args, check=True, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
        )
    except subprocess.CalledProcessError as error:
        raise RuntimeError(
            f"{' '.join(args)} exited {error.returncode}: {error.stderr.strip()}"
        ) from error
    return done.stdout


def ensure_installed() -> None:
    """Installs slurmctld, slurmd, the client commands and munge when any is missing."""
    if all(executable(name) for name in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    run(["bash", str(INSTALL_SCRIPT)], timeout=INSTALL_TIMEOUT_S)


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports that were free a moment ago."""
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaps counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop_pid(pid: int, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, up to ``timeout_s`` for the process to go, then SIGKILL (and as long again)."""
    for sig in (signals.SIGTERM, signals.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not alive(pid):
            return


def read_pid(path: Path, timeout_s: float = START_TIMEOUT_S) -> int:
    """The PID a daemon wrote to ``path`` (daemons write it after forking: waited for)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = path.read_text().strip() if path.exists() else ""
        if text.isdigit():
            return int(text)
        time.sleep(0.1)
    raise TimeoutError(f"no PID in {path} after {timeout_s:.0f} s")


def processes_of(conf: Path) -> list[psutil.Process]:
    """Live processes whose environment names ``conf``: the daemons, their slurmstepd and the
    jobs (sbatch exports SLURM_CONF into them)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            if process.environ().get("SLURM_CONF") == str(conf):
                process.name()  # cached: the caller can name it after it is gone
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def slurm_conf(directory: Path, host: str, ports: list[int]) -> str:
    """slurm.conf of a one-node cluster whose files all live in ``directory``."""
    memory_mb = int(psutil.virtual_memory().total / 2**20 * 0.95)
    lines = [
        "ClusterName=local",
        f"SlurmctldHost={host}(127.0.0.1)",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"SlurmctldPort={ports[0]}",
        f"SlurmdPort={ports[1]}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"StateSaveLocation={directory / 'state'}",
        f"SlurmdSpoolDir={directory / 'spool'}",
        f"SlurmctldPidFile={directory / 'slurmctld.pid'}",
        f"SlurmdPidFile={directory / 'slurmd.pid'}",
        f"SlurmctldLogFile={directory / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={directory / 'log' / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=batch_sched_delay=0",
        "ReturnToService=2",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "JobCompType=jobcomp/none",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        f"KillWait={KILL_WAIT_S}",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={memory_mb}"
        " State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
    ]
    return "\n".join(lines) + "\n"


class LocalSlurm:
    """slurmctld + slurmd (+ munged when none runs) on this machine, configured in ``directory``.

    Use as a context manager; ``env`` is the environment for sbatch, squeue, scancel and the
    like, and the helper methods wrap the few commands tests need.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.conf = self.directory / "slurm.conf"
        self.log_dir = self.directory / "log"
        self.host = socket.gethostname().split(".")[0]
        self.pids: dict[str, int] = {}  # the daemons we started, by name

    @property
    def env(self) -> dict[str, str]:
        """os.environ (as it is now) plus SLURM_CONF naming this cluster's configuration."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def __enter__(self) -> LocalSlurm:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Installs what is missing, writes slurm.conf, starts the daemons, waits for idle."""
        ensure_installed()
        for sub in ("state", "spool", "log"):
            (self.directory / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(slurm_conf(self.directory, self.host, free_ports(2)))
        try:
            self._start_munged()
            self._start_daemon("slurmctld", ["-c", "-f", str(self.conf)])
            self._start_daemon("slurmd", ["-f", str(self.conf)])
            self._wait_idle(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start_munged(self) -> None:
        for process in psutil.process_iter(["name"]):
            if process.info["name"] == "munged" and alive(process.pid):
                return  # someone else's munged: used, never stopped
        MUNGE_RUN.mkdir(parents=True, exist_ok=True)
        shutil.chown(MUNGE_RUN, "munge", "munge")
        MUNGE_PID_FILE.unlink(missing_ok=True)
        munged = executable("munged") or "/usr/sbin/munged"
        run(["runuser", "-u", "munge", "--", munged, "--num-threads=2"])
        self.pids["munged"] = read_pid(MUNGE_PID_FILE)

    def _start_daemon(self, name: str, args: list[str]) -> None:
        pid_file = self.directory / f"{name}.pid"
        pid_file.unlink(missing_ok=True)
        binary = executable(name) or f"/usr/sbin/{name}"
        try:
            run([binary, *args], env=self.env)
            self.pids[name] = read_pid(pid_file)
        except (RuntimeError, TimeoutError) as error:
            raise RuntimeError(f"{name} did not start: {error}\n{self.log_tails()}") from error

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            try:
                state = run(["sinfo", "-h", "-o", "%T"], env=self.env).strip()
            except RuntimeError as error:  # slurmctld not listening yet
                state = str(error)
            if state == "idle":
                return
            time.sleep(POLL_S)
        raise TimeoutError(
            f"node not idle after {timeout_s:.0f} s (sinfo: {state!r})\n{self.log_tails()}"
        )

    def log_tails(self, lines: int = 20) -> str:
        """The last ``lines`` lines of each daemon log, for error messages."""
        parts = []
        for log in sorted(self.log_dir.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name} ---\n" + "\n".join(tail))
        return "\n".join(parts) or f"(no logs in {self.log_dir})"

    def stop(self) -> None:
        """Cancels the cluster's jobs, stops the daemons we started (slurmd, slurmctld, then
        munged) by PID, and checks that nothing of them or of their jobs is left."""
        if "slurmctld" in self.pids and alive(self.pids["slurmctld"]):
            self._cancel_all()
        for name in ("slurmd", "slurmctld", "munged"):
            if name in self.pids:
                stop_pid(self.pids[name])
        left = {name: pid for name, pid in self.pids.items() if alive(pid)}
        strays = {p.pid: p.name() for p in processes_of(self.conf)}
        for pid in [*left.values(), *strays]:
            stop_pid(pid, timeout_s=1.0)  # so the next run starts clean; still a failure
        self.pids.clear()
        assert not left, f"daemons outlived stop(): {left}"
        assert not strays, f"processes of {self.conf} outlived stop(): {strays}"

    def _cancel_all(self) -> None:
        try:
            run(["scancel", "--partition=debug"], env=self.env)
        except RuntimeError:
            return  # the controller is not answering: stopping by PID still follows
        deadline = time.monotonic() + KILL_WAIT_S + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            if not run(["squeue", "-h", "-o", "%i"], env=self.env).strip():
                return
            time.sleep(POLL_S)

    def sbatch(self, args: list[str], script: str | Path) -> int:
        """Submits ``script`` with ``args`` (run from ``directory``, where slurm-%j.out land)."""
        out = run(["sbatch", "--parsable", *args, str(script)], self.env, cwd=self.directory)
        return int(out.strip().split(";")[0])

    def show_job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (finished jobs stay for MinJobAge, 300 s)."""
        out = run(["scontrol", "show", "job", "--oneliner", str(job_id)], env=self.env)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def state(self, job_id: int) -> str:
        """The job's state: PENDING, RUNNING, COMPLETING, COMPLETED, FAILED, CANCELLED, ..."""
        try:
            state = run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], env=self.env).strip()
        except RuntimeError:  # no longer in the queue
            state = ""
        return state or self.show_job(job_id)["JobState"]

    def exit_code(self, job_id: int) -> int:
        """The job's exit code (``a`` of ExitCode=a:b; ``b`` is the signal)."""
        return int(self.show_job(job_id)["ExitCode"].split(":")[0])

    def wait(self, job_id: int, timeout_s: float) -> str:
        """Polls until the job reaches a final state, which it returns."""
        deadline = time.monotonic() + timeout_s
        while (state := self.state(job_id)) not in FINAL_STATES:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state} after {timeout_s:.0f} s")
            time.sleep(POLL_S)
        return state

    def scancel(self, job_id: int, signal: str | None = None) -> None:
        """``scancel`` the job, or with ``signal`` only send it that signal (``--full``: the
        batch shell too, not only its steps)."""
        args = ["scancel", str(job_id)]
        if signal is not None:
            args[1:1] = [f"--signal={signal}", "--full"]
        run(args, env=self.env)
