"""OwnedProcess: a server process this rank starts, checks and stops by its PID.

It runs in its own session (process group = its PID) so that stopping it also stops whatever
it spawns (SGLang's scheduler and detokenizer): SIGKILL to the group, then wait until it is
gone. It is killed if the rank that started it dies, and never sees torchrun's environment.

Ports: ``free_port`` picks one below the kernel's ephemeral range, and a server counts as up
only while its own process tree listens on its port, so that a probe is never answered by
whoever else bound it. A server that lost a port it was given by ``free_port`` to another
process before binding it starts again once on a new one.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil

from relax_launch import http
from relax_launch.deadline import Deadline
from relax_launch.processes import group_alive

log = logging.getLogger("relax_launch.process")

PROBE = {"text": "Hello", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
LOWEST_PORT = 20000
_pick = random.SystemRandom()  # never the same sequence in ranks seeded alike


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` a moment ago, below the kernel's ephemeral range: the kernel
    hands ports of that range to every port-0 bind and outgoing connection, and a port probed
    there went to another listener before the server bound it (an engine, 10 s after the probe)."""
    low = lowest_ephemeral_port()
    for _ in range(200 if low > LOWEST_PORT + 1000 else 0):
        port = _pick.randrange(LOWEST_PORT, low)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # no room below the range: the kernel's pick
        sock.bind((host, 0))
        return sock.getsockname()[1]


def lowest_ephemeral_port() -> int:
    """The start of the kernel's range for port-0 binds and outgoing connections (Linux; its
    default elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class ProcessStartError(RuntimeError):
    """A server did not come up; the message carries the tail of its log."""


class OwnedProcess:
    """A generation server on ``host:port``: subclasses give ``command()``; it is ready once it
    listens on its port and has generated one real token. ``port=None``: one from
    ``free_port``."""

    def __init__(self, *, host: str, port: int | None, log_path: str | Path, what: str) -> None:
        self.host, self.port, self.port_chosen = host, port or free_port(host), port is None
        self.log_path, self.what = Path(log_path), what
        self.process: subprocess.Popen[bytes] | None = None
        self.served = False  # ready once: others know its URL, so it keeps its port
        self._log_start = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def choose_ports(self) -> None:
        """New ports, after another process took one (subclasses with more ports re-pick all)."""
        self.port = free_port(self.host)

    def probe(self, timeout_s: float) -> None:
        """Raises until the server generates a token (the router answers 503 while it has no
        healthy worker)."""
        http.call(
            "POST", self.url + "/generate", json=PROBE, timeout_s=timeout_s
        ).raise_for_status()

    def env(self, base: dict[str, str]) -> dict[str, str]:
        return base

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self, timeout_s: float) -> None:
        """Start the process and return once ``probe`` passes, or raise (and stop it)."""
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the process without waiting for it (``wait_ready`` does), so that several
        servers, or a server and the trainer's build, start at once."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self._log_start = log_file.tell()
            self.process = subprocess.Popen(
                self.command(),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self.env(_without_torchrun_env(os.environ)),
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def wait_ready(self, timeout_s: float) -> None:
        """Return once ``probe`` passes, or raise (and stop the process)."""
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        self.served = True

    def _wait_ready(self, timeout_s: float) -> None:
        deadline, moved, why = Deadline(timeout_s), False, "not started"
        while not deadline.passed:
            listening = self._listening()
            if not listening and self._port_taken():
                if moved or self.served or not self.port_chosen:
                    raise ProcessStartError(
                        f"{self.what}: an address it binds, port {self.port} on {self.host} or "
                        f"one of its own, is taken by another process; free it or give another "
                        f"port:\n{self.log_tail()}"
                    )
                log.warning("%s lost port %d to another process; new port", self.what, self.port)
                self.stop()
                self.choose_ports()
                self.launch()
                moved = True
                continue
            if self.process.poll() is not None:
                raise ProcessStartError(
                    f"{self.what} exited with code {self.process.returncode} while starting:\n"
                    f"{self.log_tail()}"
                )
            why = f"nothing of it listens on port {self.port} yet"
            try:
                if listening:
                    self.probe(timeout_s=5)
                    return
            except (http.TransportError, TimeoutError, OSError) as exc:
                why = f"its last probe: {type(exc).__name__}: {exc}"
            time.sleep(0.5)
        raise ProcessStartError(
            f"{self.what} at {self.url} was not ready within {timeout_s:.0f} s ({why}):\n"
            f"{self.log_tail()}"
        )

    def _listening(self) -> bool:
        """Whether this process, or one it started, listens on ``port`` (if no process of the
        tree can be inspected, as under a procfs that hides them, the probe alone decides)."""
        try:
            root = psutil.Process(self.process.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return False
        inspected = False
        for process in tree:
            try:
                sockets = process.net_connections(kind="tcp")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            inspected = True
            if any(s.status == psutil.CONN_LISTEN and s.laddr.port == self.port for s in sockets):
                return True
        return not inspected

    def _port_taken(self) -> bool:
        """Whether the server's log since its launch says its port was in use."""
        try:
            with open(self.log_path, "rb") as log_file:
                log_file.seek(self._log_start)
                return b"address already in use" in log_file.read().lower()
        except OSError:
            return False

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.is_file():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGKILL the server's process group and wait until it is gone. Idempotent.

        Not SIGTERM: SGLang's launcher takes 5-10 s to stop on it (it reads its scheduler's
        exit as a crash and waits for diagnostics), and a server holds nothing to save.
        """
        if self.process is None or self.process.poll() is not None and not group_alive(self.pid):
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        deadline = Deadline(timeout_s)
        while not deadline.passed and group_alive(self.process.pid):
            self.process.poll()
            time.sleep(0.05)
        self.process.wait(timeout=5)


# Set by torchrun for its workers; SGLang reads some of them (e.g. LOCAL_RANK picks a NUMA node)
# and its own process group must not rendezvous on the job's store.
_TORCHRUN_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _without_torchrun_env(env: os._Environ[str] | dict[str, str]) -> dict[str, str]:
    return {
        k: v for k, v in env.items() if k not in _TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")
    }


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """In the child, before exec: kill it when the process that started it dies (Linux).

    A rank killed with SIGKILL runs no cleanup; without this its server would outlive the job.
    SGLang's scheduler and detokenizer follow their launcher by the same mechanism.
    """
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signum)  # 1 = PR_SET_PDEATHSIG
