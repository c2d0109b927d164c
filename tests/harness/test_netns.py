"""The two-node network harness: each node reaches the other only at its own address (never
through 127.0.0.1), the host cannot reach either, and leaving it kills what ran inside and
deletes both namespaces, also when entering failed halfway.

What a process inside a node learns about its own address (asserted below):
``gethostbyname(gethostname())`` is never the node's address (the UTS hostname is the host's;
here ``/etc/hosts`` maps it to 127.0.0.1), while a UDP ``connect((peer, 1))`` then
``getsockname()[0]`` is: that is how a node finds the address it advertises.
"""

from __future__ import annotations

import ipaddress
import json
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import netns
import psutil
import pytest
from netns import NodeNetwork

PYTHON = sys.executable  # the project's .venv python that runs the tests
RUN_TIMEOUT_S = 20.0

FETCH = """
import sys, time, urllib.request
url, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
while True:
    try:
        print(urllib.request.urlopen(url, timeout=1).status)
        break
    except OSError as error:
        if time.monotonic() > deadline:
            sys.exit(f"{url}: {error!r}")
        time.sleep(0.05)
"""

CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
    print("connected")
except OSError as error:
    print(type(error).__name__)
"""

ADDRESSES = """
import json, socket, sys
try:
    resolved = socket.gethostbyname(socket.gethostname())
except OSError as error:
    resolved = repr(error)
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.connect((sys.argv[1], 1))  # UDP connect sends nothing; it only picks a route
print(json.dumps({"hostname": socket.gethostname(), "resolved": resolved,
                  "advertised": udp.getsockname()[0]}))
"""


@pytest.fixture(autouse=True)
def namespaces_available() -> None:
    if (reason := netns.available()) is not None:
        pytest.skip(reason)


def listed_namespaces() -> str:
    return subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=True
    ).stdout


def host_cannot_reach(address: str, port: int) -> None:
    """The host's namespace has no link to ``address``: a connect that may not leave through a
    gateway (SO_DONTROUTE) fails at once, so no packet leaves the host to prove it."""
    host_addresses = subprocess.run(
        ["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
    assert f" {address}/" not in host_addresses
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_DONTROUTE, 1)
    probe.settimeout(2)
    with probe, pytest.raises(OSError, match="unreachable"):
        probe.connect((address, port))


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie waiting for its parent (init) to reap it."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_node1_reaches_node0_only_at_its_address(tmp_path: Path):
    port = 18000 + secrets.randbelow(1000)
    with NodeNetwork() as network:
        node0, node1 = network.nodes
        server = node0.popen(
            [PYTHON, "-m", "http.server", "--bind", node0.address, str(port)],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        url = f"http://{node0.address}:{port}/"
        fetched = node1.run([PYTHON, "-c", FETCH, url, "10"], timeout_s=RUN_TIMEOUT_S)
        assert (fetched.returncode, fetched.stdout.strip()) == (0, "200"), fetched.stderr
        local = node1.run([PYTHON, "-c", CONNECT, "127.0.0.1", str(port)])
        assert local.stdout.strip() == "ConnectionRefusedError", local.stderr
        host_cannot_reach(node0.address, port)
        assert server.poll() is None, "the server must still be up when the network closes"
    listed = listed_namespaces()
    assert node0.name not in listed and node1.name not in listed, listed
    assert server.returncode is not None, "the harness reaps what it started"
    assert not psutil.pid_exists(server.pid) or gone(server.pid)


def test_exit_kills_processes_that_left_their_parent():
    with NodeNetwork() as network:
        shell = network.nodes[1].popen(
            ["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], stdout=subprocess.PIPE, text=True
        )
        orphan = int(shell.communicate(timeout=RUN_TIMEOUT_S)[0])
        assert shell.returncode == 0 and not gone(orphan)
    deadline = time.monotonic() + 60  # only a hang: the kernel kills it at once
    while not gone(orphan) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(orphan), f"sleep {orphan} outlived its namespace"


def test_failed_enter_deletes_what_it_made(monkeypatch: pytest.MonkeyPatch):
    def fail_after_namespaces(self: NodeNetwork, prefixlen: int) -> None:
        listed = listed_namespaces()
        assert all(name in listed for name in self.names), listed
        raise netns.NetnsError("failed halfway on purpose")

    monkeypatch.setattr(NodeNetwork, "_link_nodes", fail_after_namespaces)
    network = NodeNetwork()
    with pytest.raises(netns.NetnsError, match="on purpose"), network:
        pytest.fail("entered a network whose setup failed")
    listed = listed_namespaces()
    assert not any(name in listed for name in network.names), listed


def test_a_node_finds_its_own_address_by_routing_not_by_hostname():
    with NodeNetwork() as network:
        subnet = ipaddress.IPv4Network(network.subnet)
        seen = {}
        for node, peer in zip(network.nodes, reversed(network.nodes), strict=True):
            reply = node.run([PYTHON, "-c", ADDRESSES, peer.address], timeout_s=RUN_TIMEOUT_S)
            assert reply.returncode == 0, reply.stderr
            seen[node.name] = json.loads(reply.stdout)
            assert seen[node.name]["advertised"] == node.address
    hostnames = {found["hostname"] for found in seen.values()}
    assert hostnames == {socket.gethostname()}, "ip netns exec keeps the host's UTS hostname"
    for found in seen.values():  # 127.0.0.1 here (/etc/hosts), or an error: never the node
        try:
            resolved = ipaddress.IPv4Address(found["resolved"])
        except ValueError:
            continue  # did not resolve at all: no address to fall back to either
        assert resolved not in subnet, found
