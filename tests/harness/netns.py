"""Two or more "nodes" on one host, each in its own network namespace with its own address.

Why: a multi-node job (two torchrun agents, a trainer and a remote engine) tested on one host
normally runs every process in the host's network namespace, where every address of the host
reaches every process and ``127.0.0.1`` is shared. A component that advertises or dials
loopback (``MASTER_ADDR=127.0.0.1``, ``gethostbyname(gethostname())``, a default of
``localhost``) then still works in the test and fails on a real cluster. Here each node is a
namespace of its own, ``relax-n0-<sfx>`` and ``relax-n1-<sfx>``, joined by one veth pair and
nothing else: node 0 has ``10.a.b.1/24`` on its veth end, node 1 has ``10.a.b.2/24`` (three or
more nodes meet on a bridge in a switch namespace of its own, which has no address). Inside a
node, ``127.0.0.1`` is that node's private loopback, so a peer reached through it is refused,
and the host's own namespace has no link to either node (no traffic leaves the namespaces).

What a process inside a node sees (measured on Debian 12, see ``test_netns.py``):

- ``socket.gethostname()`` is the host's name: ``ip netns exec`` does not unshare the UTS
  namespace, so both nodes share one hostname. ``gethostbyname`` of it answers whatever the
  host's ``/etc/hosts`` says (here ``127.0.0.1``) or fails (DNS is unreachable from a node);
  it never answers the node's address. No ``/etc/netns/<name>/hosts`` is written on purpose:
  with one shared hostname, a per-node hosts file could only map that name to each node's
  *own* address, so a peer resolving the name a node advertises would reach itself; leaving it
  unresolvable to a node address keeps the hostname fallback visibly broken, as on a cluster
  whose hostnames do not resolve to the right interface.
- The address a node should advertise to a peer is the source address the kernel picks to
  reach that peer: a UDP socket ``connect((peer_address, 1))`` (no packet is sent) then
  ``getsockname()[0]`` gives the node's own veth address.
- ``/dev/shm`` is the node's own (``Node.command`` runs every process in a mount namespace with
  a fresh tmpfs there): namespaces alone would share the host's, and SGLang, which decides that
  two ranks are on one node when they can open each other's POSIX shared memory, would then
  wire its message queues over 127.0.0.1 between nodes.

``available()`` says why namespaces cannot be made here (not root, no iproute2, a sandbox that
refuses them), so a test can skip with that reason. Leaving the ``with`` block kills every
process still inside a node's namespace (by PID, from ``ip netns pids``) and deletes every
namespace, which also removes the veth pairs; this runs even when entering failed halfway.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

IP_TIMEOUT_S = 10.0  # one `ip` command; they take milliseconds
KILL_WAIT_S = 10.0  # for the processes in a namespace to be gone after SIGKILL
REAP_TIMEOUT_S = 5.0  # for a killed child of ours to be reaped
NODE_COUNT = 2
PRIVATE_SHM = (
    "unshare", "--mount", "--propagation", "private",
    "sh", "-c", 'mount -t tmpfs none /dev/shm && exec "$@"', "node",
)  # fmt: skip
SUBNET_TRIES = 64


class NetnsError(RuntimeError):
    """An ``ip`` command failed; the message carries its stderr."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs ``ip ARGS`` with a timeout; raises NetnsError with stderr if it fails and check."""
    done = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
    )
    if check and done.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


@dataclass
class Node:
    """One node: a network namespace, its address on the shared link, and its veth name."""

    name: str
    address: str
    interface: str
    started: list[subprocess.Popen[Any]] = field(default_factory=list, repr=False)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this node's namespace, with a ``/dev/shm`` of its own (a mount
        namespace with a fresh tmpfs there): nodes share no POSIX shared memory, as separate
        hosts do not, so nothing can take two nodes for one (SGLang's same-node test does)."""
        return ["ip", "netns", "exec", self.name, *PRIVATE_SHM, *argv]

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Starts ``argv`` inside the node; the network's exit kills and reaps it."""
        process = subprocess.Popen(self.command(argv), **kwargs)
        self.started.append(process)
        return process

    def kill_all(self) -> None:
        """SIGKILLs every process inside the node at once, as when the node itself dies."""
        if left := _kill_all_in(self.name):
            raise NetnsError(f"processes {left} in {self.name} survived SIGKILL")

    def run(
        self, argv: list[str], timeout_s: float = 30.0, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Runs ``argv`` inside the node to completion, output captured as text."""
        return subprocess.run(
            self.command(argv), capture_output=True, text=True, timeout=timeout_s, **kwargs
        )


def _host_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks the host's own namespace has an address in or a route to."""
    networks = []
    for args in (("-o", "-4", "addr", "show"), ("-4", "route", "show", "table", "all")):
        for word in _ip(*args).stdout.split():
            try:
                networks.append(ipaddress.IPv4Network(word, strict=False))
            except ValueError:
                continue
    return [n for n in networks if n.prefixlen > 0]  # `default` never parses; 0.0.0.0/0 is it


def _pick_subnet() -> ipaddress.IPv4Network:
    """A random 10.200-250.x.0/24 the host does not use, so the host can't reach it by chance.

    Parallel harnesses may pick the same /24: each pair of namespaces is its own world.
    """
    used = _host_networks()
    for _ in range(SUBNET_TRIES):
        subnet = ipaddress.IPv4Network(
            f"10.{200 + secrets.randbelow(51)}.{secrets.randbelow(256)}.0/24"
        )
        if not any(subnet.overlaps(n) for n in used):
            return subnet
    raise NetnsError(f"no free 10.200-250.x.0/24 on this host: it uses {used}")


def _namespace_exists(name: str) -> bool:
    listed = _ip("netns", "list", check=False).stdout.split()
    return name in listed


def _pids_in(name: str) -> list[int]:
    """PIDs of the live processes in namespace ``name`` (zombies have left it)."""
    done = _ip("netns", "pids", name, check=False)
    return [int(word) for word in done.stdout.split()] if done.returncode == 0 else []


def _kill_all_in(name: str) -> list[int]:
    """SIGKILLs every process in the namespace until none is left; returns any left after
    KILL_WAIT_S."""
    deadline = time.monotonic() + KILL_WAIT_S
    while pids := _pids_in(name):
        if time.monotonic() > deadline:
            return pids
        for pid in pids:  # again each round: a process may have forked before it died
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        time.sleep(0.05)
    return []


class NodeNetwork:
    """Context manager: ``count`` node namespaces on one link; ``nodes`` are node 0, 1, ...

    Two nodes are joined by one veth pair; more by a bridge inside a switch namespace of its
    own (``relax-sw-<sfx>``, no address), each node on it by a veth pair."""

    def __init__(self, count: int = NODE_COUNT) -> None:
        self.suffix = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.names = [f"relax-n{i}-{self.suffix}" for i in range(count)]
        self.switch = f"relax-sw-{self.suffix}" if count > 2 else None
        self.nodes: list[Node] = []
        self.subnet: ipaddress.IPv4Network | None = None

    def __enter__(self) -> NodeNetwork:
        try:
            self._create()
        except BaseException:
            self._cleanup()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._cleanup()

    def _create(self) -> None:
        self.subnet = _pick_subnet()
        hosts = list(self.subnet.hosts())
        for index, name in enumerate(self.names):
            _ip("netns", "add", name)
            self.nodes.append(Node(name, str(hosts[index]), f"relax-veth{index}"))
        self._link_nodes(self.subnet.prefixlen)

    def _link_nodes(self, prefixlen: int) -> None:
        """veth pairs created straight inside the namespaces (never in the host's): node to
        node for two, node to the switch's bridge for more."""
        if self.switch is None:
            first, second = self.nodes
            _ip(
                "link", "add", first.interface, "netns", first.name, "type", "veth",
                "peer", "name", second.interface, "netns", second.name,
            )  # fmt: skip
        else:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for index, node in enumerate(self.nodes):
                port = f"port{index}"
                _ip(
                    "link", "add", node.interface, "netns", node.name, "type", "veth",
                    "peer", "name", port, "netns", self.switch,
                )  # fmt: skip
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
        for node in self.nodes:
            _ip("-n", node.name, "link", "set", "lo", "up")
            address = f"{node.address}/{prefixlen}"
            _ip("-n", node.name, "addr", "add", address, "dev", node.interface)
            _ip("-n", node.name, "link", "set", node.interface, "up")

    def _cleanup(self) -> None:
        """Kills what runs inside, deletes every namespace; raises if anything is left."""
        problems = []
        for name in [*self.names, *([self.switch] if self.switch else [])]:
            if not _namespace_exists(name):
                continue
            if left := _kill_all_in(name):
                problems.append(f"processes {left} in {name} survived SIGKILL")
            done = _ip("netns", "delete", name, check=False)
            if done.returncode != 0:
                problems.append(f"`ip netns delete {name}`: {done.stderr.strip()}")
        for node in self.nodes:
            for process in node.started:
                try:
                    process.wait(timeout=REAP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    problems.append(f"{process.args} (pid {process.pid}) was not reaped")
        if problems:
            raise NetnsError("; ".join(problems))


def available() -> str | None:
    """None when two namespaces can be made and entered here, else why not (for a skip)."""
    if os.geteuid() != 0:
        return f"network namespaces need root (euid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    if shutil.which("unshare") is None:
        return "`unshare` (util-linux) is not installed"
    try:
        with NodeNetwork() as network:
            network.nodes[0].run(["true"], timeout_s=IP_TIMEOUT_S, check=True)
    except (OSError, subprocess.SubprocessError, NetnsError) as error:
        return f"cannot create network namespaces here: {error}"
    return None
