"""What the RL program needs of a running job, as protocols: the job itself (its trainer, its
engines, the weight sync, its stop request), and the coordinator colocated roles take turns
under. ``runtime/`` implements them for one torchrun job (``runtime.session.Session``,
``runtime.stop.StopRequest``, ``runtime.lifecycle.LifecycleCoordinator``); ``rl/`` imports no
module of it. Also the two exceptions a stop travels by.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rich.console import Console

    from relax_launch.inference.inprocess import EngineClients
    from relax_launch.placement.plan import PlacementPlan
    from relax_launch.trainer.batch import TokenBatch
    from relax_launch.trainer.losses import LossSpec


class StepAbandoned(BaseException):  # noqa: N818 - not an error: the step was dropped on request
    """Raised in rank 0's main thread, inside an abandonable wait, once the job is asked to
    stop: nothing of the step in flight is trained. A ``BaseException``, like
    ``KeyboardInterrupt``: a reward function's ``except Exception`` must not swallow it."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"abandoned for a stop ({reason})")
        self.reason = reason


class JobStopped(Exception):  # noqa: N818 - not an error: the job stopped on request
    """Raised out of the program once it stopped on request: ``step`` steps of ``total`` done,
    ``checkpoint`` the directory to resume from (None: nothing to resume)."""

    def __init__(self, reason: str, step: int, total: int, checkpoint: str | None) -> None:
        super().__init__(f"stopped by {reason} after step {step}")
        self.reason, self.step, self.total, self.checkpoint = reason, step, total, checkpoint


@dataclass
class RolloutWork:
    """What one rollout phase had to do, for the rollout autoscaler (``Job.rollout_phase``):
    the requests waiting at its start; where generation overlaps training (the fully
    asynchronous schedule) also the seconds the engines had requests in flight and the seconds
    the trainer waited for finished groups."""

    requests: int
    busy_s: float | None = None
    waited_s: float | None = None


class TurnRefused(RuntimeError):
    """A coordinator refused a grant, a release or a commit; its message names the role."""


class Stop(Protocol):
    """A request to stop the job, as rank 0 sees it (``runtime.stop.StopRequest``)."""

    listeners: list[Callable[[str], None]]  # run once when a request is first known
    stepping: bool  # set once steps run: from then on a stop saves what they did

    def requested(self, wait_s: float = 0.0) -> str | None: ...
    def check(self) -> None: ...  # StepAbandoned if a stop is known
    def abandonable(self) -> AbstractContextManager[None]: ...
    def failed(self) -> str | None: ...  # a failure the request only followed


class Coordinator(Protocol):
    """Who holds the shared ranks of a colocated job (``runtime.lifecycle``)."""

    members: Mapping[str, Any]  # role -> its registration (``describe()`` names its ranks)

    def begin_batch(self, batch: int) -> None: ...
    def commit_batch(self, batch: int) -> None: ...
    def fail_batch(self, batch: int, why: str) -> None: ...
    def activate(
        self, role: str, parts: tuple[str, ...] | None = None, operation_id: str | None = None
    ) -> dict[str, float]: ...
    def deactivate(
        self, role: str, parts: tuple[str, ...] | None = None, operation_id: str | None = None
    ) -> dict[str, float]: ...
    def holding(self) -> list[str]: ...  # inference roles that hold memory, in their order
    def close(self) -> None: ...


class CriticMemory(Protocol):
    """Where the value model's state is within the trainer's turn (``runtime/critic_turns.py``):
    each method moves what the next moment needs; ``done`` ends the turn, also after a failure."""

    def scoring(self) -> None: ...
    def policy_training(self) -> None: ...
    def critic_training(self) -> None: ...
    def done(self) -> None: ...
    def take_moved(self) -> dict[str, float]: ...  # bytes by direction since the last call


class Job(Protocol):
    """One running job, driven from rank 0 (``runtime.session.Session``)."""

    plan: PlacementPlan
    console: Console
    stop: Stop
    engines: EngineClients  # the controller's in-process clients of every role's engines
    critic_turns: CriticMemory | None  # a job with a critic (advantage gae)
    critic_overlaps: bool  # the critic has ranks of its own: it trains while the policy does

    def bring_up(self, weight_version: int, log_dir: Path) -> dict[str, Any]: ...
    def train_step(self, batch: TokenBatch, spec: LossSpec | None = None) -> dict[str, float]: ...
    def save_trainer(self, directory: str) -> list[str]: ...
    def load_trainer(self, directory: str) -> int: ...
    def critic_values(self, batch: TokenBatch) -> list[list[float]]: ...  # advantage gae
    def train_critic(self, batch: TokenBatch, value_clip: float | None) -> dict[str, float]: ...
    def start_critic(self, batches: list[TokenBatch], value_clip: float | None) -> Any: ...
    def finish_critic(self, started: Any) -> list[dict[str, float]]: ...  # start_critic's steps
    def order_ticket(self) -> int: ...  # the job's event counter, shared by its ranks
    def export_trainer(self, directory: str, dtype: str) -> dict[str, str]: ...
    def sync_weights(self, weight_version: int) -> list[dict[str, Any]]: ...
    def check_parity(self) -> None: ...  # a colocated sync's engines score the parity probe
    def engine_metrics(self) -> dict[str, float]: ...
    def abort_rollout(self) -> None: ...  # abort what the rollout engines generate now
    def rollout_phase(self, requests: int) -> AbstractContextManager[RolloutWork]: ...
    def coordinator(self, operation_timeout_s: float, log_path: Path) -> Coordinator: ...


def turns_of(coordinator: Coordinator) -> Iterator[str]:
    """The inference roles registered with ``coordinator``, in its order."""
    return (role for role in coordinator.members if role != "trainer")
