"""The address a node gives the job, and the interface its collectives use.

On one node everything is loopback. On several, a node's address is the one its traffic to the
job's master (torchrun's ``MASTER_ADDR``, node 0) leaves from: the kernel's route picks it, so it
is right inside containers, on hosts with several interfaces and where the host name resolves to
127.0.1.1 (Debian's default), all of which break ``gethostbyname(gethostname())``. Engines bind
it, the gateway and the trainer reach them at it, and gloo/NCCL are pointed at its interface
(``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``, unless the operator set them) so no collective
silently falls back to loopback. ``RELAX_NODE_ADDRESS`` overrides the address.
"""

from __future__ import annotations

import logging
import os
import socket

import psutil

from relax_launch.placement.plan import PlacementPlan

ADDRESS_ENV = "RELAX_NODE_ADDRESS"
INTERFACE_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
log = logging.getLogger(__name__)


def node_address(plan: PlacementPlan) -> str:
    """Where the other nodes reach this one (see the module docstring)."""
    if os.environ.get(ADDRESS_ENV):
        return os.environ[ADDRESS_ENV]
    if plan.nnodes == 1:
        return "127.0.0.1"
    return route_source(os.environ.get("MASTER_ADDR", "127.0.0.1"))


def route_source(peer: str) -> str:
    """The local address of this host's route to ``peer`` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(peer), 9))
        return probe.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The network interface that holds ``address``."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addresses):
            return name
    return None


def configure_network(plan: PlacementPlan) -> None:
    """Point gloo and NCCL at this node's interface on a multi-node job (before the process
    group starts; engine servers inherit it)."""
    if plan.nnodes == 1:
        return
    address = node_address(plan)
    interface = interface_of(address)
    for variable in INTERFACE_ENVS:
        if interface and not os.environ.get(variable):
            os.environ[variable] = interface
    log.info(
        "node address %s (interface %s; %s)",
        address,
        interface,
        ", ".join(f"{v}={os.environ.get(v, '')}" for v in INTERFACE_ENVS),
    )
