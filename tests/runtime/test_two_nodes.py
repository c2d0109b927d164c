"""A job over two nodes on one host: two torchrun agents (``--nnodes 2``, node ranks 0 and 1,
static rendezvous, as the sbatch script starts them), the trainer (TP 2) on node 0, a rollout
and a teacher engine on node 1 (tests/runtime/two_nodes_tiny.yaml). And over three: a rollout
engine spanning nodes 1 and 2, one SGLang process on each (tests/runtime/spanning_engine_tiny.yaml).

Each node runs in its own network namespace with its own address (tests/harness/netns.py):
inside a node, 127.0.0.1 is that node's alone, so anything that advertised or dialled loopback
across nodes would fail here. The same job also runs with both agents on the host's loopback,
for machines without namespaces (slow suite).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from harness import netns
from harness.processes import TEST_TAG, seconds_until_gone

from relax_launch.commands.launcher import ENTRY_MODULE, torchrun_command
from relax_launch.config import load_config
from relax_launch.inference.process import free_port
from relax_launch.placement import plan

pytestmark = pytest.mark.e2e
CONFIG = Path(__file__).parent / "two_nodes_tiny.yaml"
SPANNING = Path(__file__).parent / "spanning_engine_tiny.yaml"
ALL_GONE_S = 30.0
JOB_TIMEOUT_S = 600.0
NO_NETNS = netns.available()
needs_netns = pytest.mark.skipif(NO_NETNS is not None, reason=str(NO_NETNS))


class TwoNodeJob:
    """The agents of one job, one per node (two unless ``config`` plans more); ``nodes`` are
    namespaces (None: the host, on loopback)."""

    def __init__(
        self,
        tmp_path: Path,
        nodes: list[netns.Node] | None,
        *overrides: str,
        node1_overrides: tuple[str, ...] = (),
        node1_prefix: tuple[str, ...] = (),
        config: Path = CONFIG,
    ) -> None:
        rewards = str(Path(__file__).parents[1] / "rl")  # tiny_rewards, for configs that use it
        path = os.pathsep.join(filter(None, [rewards, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        self.run_dir, self.tag = tmp_path / "run", os.environ[TEST_TAG]
        master = nodes[0].address if nodes else "127.0.0.1"
        placement = plan(load_config(config, ()))
        port, self.agents, self.logs = free_port(), [], []
        for node_rank in range(placement.nnodes):
            args = [str(config), f"logging.dir={self.run_dir}", *overrides]
            args += list(node1_overrides) if node_rank == 1 else []
            command = torchrun_command(ENTRY_MODULE, args, placement, port, node_rank, master)
            command = [*node1_prefix, *command] if node_rank == 1 else command
            log = open(tmp_path / f"agent{node_rank}.log", "w")  # noqa: SIM115 - closed in finish
            start = nodes[node_rank].popen if nodes else subprocess.Popen
            self.agents.append(start(command, stdout=log, stderr=subprocess.STDOUT, env=env))
            self.logs.append(log)

    def wait_for_steps(self, steps: int, timeout_s: float = JOB_TIMEOUT_S) -> None:
        metrics, deadline = self.run_dir / "metrics.jsonl", time.monotonic() + timeout_s
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= steps):
            assert all(a.poll() is None for a in self.agents), self.consoles()
            assert time.monotonic() < deadline, f"no {steps} steps in {timeout_s} s"
            time.sleep(0.2)

    def finish(self, timeout_s: float = JOB_TIMEOUT_S) -> list[int]:
        """Every agent's exit code, once all have ended."""
        try:
            return [agent.wait(timeout=timeout_s) for agent in self.agents]
        finally:
            for log in self.logs:
                log.close()

    def consoles(self) -> str:
        return "\n".join(Path(log.name).read_text(errors="replace") for log in self.logs)

    def metrics(self) -> list[dict]:
        rows = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(row) for row in rows]

    def seconds_until_gone(self, since: float, limit_s: float = 90) -> float:
        return seconds_until_gone(self.tag, since, limit_s)


def trains_and_syncs_for_three_steps(job: TwoNodeJob, engine_host: str) -> None:
    codes = job.finish()
    assert codes == [0, 0], job.consoles()
    rows = job.metrics()
    assert [row["step"] for row in rows] == [1, 2, 3]
    # each step's samples came from the weights the previous step synced across the link
    assert [row["weight_version"] for row in rows] == [0, 1, 2], rows[-1]
    assert all(row["sync/gb_per_s"] > 0 and "reverse_kl" in row for row in rows)  # teacher scored
    for engine in ("rollout", "teacher"):  # each served at node 1's own address
        log = (job.run_dir / f"{engine}-engine0.log").read_text()
        assert f"Uvicorn running on http://{engine_host}:" in log


@pytest.mark.slow  # the spanning engine's job below runs its nodes in namespaces of their own
@needs_netns
def test_two_nodes_each_in_its_own_network_namespace(tmp_path):
    with netns.NodeNetwork() as network:
        job = TwoNodeJob(tmp_path, network.nodes)
        trains_and_syncs_for_three_steps(job, engine_host=network.nodes[1].address)


def serves_every_synced_version(job: TwoNodeJob, node1: str) -> None:
    """The spanning job ran 3 steps; the engine generated from each synced version, its head
    serving at ``node1`` and its other node process meeting it there as TP rank 1."""
    codes = job.finish()
    assert codes == [0, 0, 0], job.consoles()
    rows = job.metrics()
    head_log = (job.run_dir / "rollout-engine0.log").read_text()
    follower_log = (job.run_dir / "rollout-engine0-node1.log").read_text()
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert [row["weight_version"] for row in rows] == [0, 1, 2], rows[-1]
    assert all(row["sync/gb_per_s"] > 0 and row["grad_norm"] > 0 for row in rows), rows
    # after each sync of changed weights, the engine's logprobs of its own tokens are the
    # trainer's: both TP shards, on both nodes, took the new weights (an engine one version
    # behind, as with algorithm.off_policy_steps=1, measures 0.012 to 0.024 on this job)
    assert all(abs(row["mismatch_kl"]) < 1e-4 for row in rows), rows
    assert f"Uvicorn running on http://{node1}:" in head_log
    assert f"'dist_init_addr': '{node1}:" in follower_log and "'node_rank': 1" in follower_log
    assert re.search(r"TP1\]", follower_log) and "TP1" not in head_log, follower_log[-2000:]


@needs_netns
def test_an_engine_spanning_two_nodes_serves_and_takes_weight_syncs(tmp_path):
    """One rollout engine, TP 2, over nodes 1 and 2 (one SGLang process each, meeting at the
    address its head published): it generates every step from the weights synced to both."""
    with netns.NodeNetwork(3) as network:
        job = TwoNodeJob(tmp_path, network.nodes, config=SPANNING)
        serves_every_synced_version(job, network.nodes[1].address)


@pytest.mark.slow
def test_an_engine_spanning_two_nodes_on_loopback(tmp_path):
    serves_every_synced_version(TwoNodeJob(tmp_path, None, config=SPANNING), "127.0.0.1")


@needs_netns
@pytest.mark.parametrize(
    "what",
    [
        pytest.param("node 1's agent", marks=pytest.mark.slow),
        pytest.param("node 1", marks=pytest.mark.slow),  # every process of node 1 at once
        pytest.param("node 0", marks=pytest.mark.slow),  # the master: the store goes with it
    ],
)
def test_a_dead_node_or_agent_ends_the_whole_job(tmp_path, what):
    with netns.NodeNetwork() as network:
        job = TwoNodeJob(tmp_path, network.nodes, "algorithm.num_steps=1000")
        job.wait_for_steps(2)
        began = time.monotonic()
        if what == "node 1's agent":
            agent = psutil.Process(job.agents[1].pid)
            assert "--node-rank 1" in " ".join(agent.cmdline())  # the agent itself
            agent.send_signal(signal.SIGKILL)
        else:
            network.nodes[int(what[-1])].kill_all()
        seconds = job.seconds_until_gone(began)
        codes = job.finish(timeout_s=ALL_GONE_S)
        console = job.consoles()
    print(f"\n{what} SIGKILL: both nodes gone in {seconds:.1f} s, exit codes {codes}")
    assert seconds < ALL_GONE_S and all(code != 0 for code in codes), console
    if what == "node 1's agent":  # whichever rank of node 1 looked first names it
        cause = r"rank [23] \((rollout|teacher)\[e0 head\], node 1\): its torchrun agent died"
        assert re.search(f"job failed: {cause}", console), console
    elif what == "node 1":  # nobody on node 1 is left to tell: rank 0 hears nothing from it
        silent = r"rank [23] \((rollout|teacher)\[e0 head\], node 1\)"  # one or both
        assert re.search(f"job failed: {silent}.* stopped answering", console), console
    else:  # node 0's console died with it; node 1's ranks name what they lost
        log = (job.run_dir / "rank2.log").read_text()
        assert "the job's store (on node 0, with rank 0) has not answered" in log, log[-2000:]


def test_nodes_given_different_configs_refuse_to_start(tmp_path):
    job = TwoNodeJob(tmp_path, None, node1_overrides=("trainer.lr=0.02",))
    codes = job.finish(timeout_s=300)
    console = job.consoles()
    assert codes[0] != 0 and codes[1] != 0, console
    assert "ranks [2, 3] planned" in console and "differs between nodes" in console, console


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's unshare")
def test_a_checkpoint_directory_node_1_cannot_see_is_refused(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    # node 1 runs in a mount namespace of its own where checkpoint.dir is an empty tmpfs: a
    # node-local directory at the same path, as on a cluster without a shared filesystem
    mount = f'mount -t tmpfs none {checkpoints} && exec "$@"'
    hide = ("unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "node1")
    job = TwoNodeJob(tmp_path, None, f"checkpoint.dir={checkpoints}", node1_prefix=hide)
    codes = job.finish(timeout_s=300)
    console = job.consoles()
    assert codes[0] != 0 and codes[1] != 0, console
    assert f"checkpoint.dir={checkpoints} is not shared between nodes: node 1" in console, console


@pytest.mark.slow
def test_two_nodes_on_loopback(tmp_path):
    job = TwoNodeJob(tmp_path, None)
    trains_and_syncs_for_three_steps(job, engine_host="127.0.0.1")
