"""While a fault-tolerant role has no engine left, its requests wait for one to come back.

A teacher or genrm engine that died is restarted by its rank and routed again as soon as it is
ready (``runtime/static_membership.py``): it serves its starting weights, so nothing else has
to happen first. Until then, a request that finds every engine of the role out of routing
waits, at most the manager's ``restart_wait_s`` (the restart's own bound) from the moment the
first one found none, instead of failing its step with 503; the operator's console says so
once per outage. A rollout engine comes back only with the next weight sync, which a rollout
phase does not wait for, so rollout requests are refused at once as before (the sync waits
instead: ``RolloutMembership``).
"""

from __future__ import annotations

import asyncio

from relax_launch.console import operator_log
from relax_launch.deadline import Deadline
from relax_launch.inference.client import InferenceError
from relax_launch.inference.discovery import WeightSource
from relax_launch.inference.manager import InferenceManager

POLL_S = 0.25  # how often a waiting request looks for an engine back in routing


class EngineOutage:
    """One role's outages: every engine out of routing, its requests waiting for one."""

    def __init__(self, manager: InferenceManager, poll_s: float = POLL_S) -> None:
        self.manager, self.poll_s = manager, poll_s
        # static weights: a restarted engine is routed again by itself, so waiting helps
        static = manager.fault_tolerant and manager.weight_source is WeightSource.STATIC
        self.bound_s = manager.restart_wait_s if static else 0.0
        self.deadline: Deadline | None = None  # the current outage's end, while one lasts

    @property
    def waits(self) -> bool:
        """Whether a request refused now waits: every engine of the role is lost (restarting,
        or gone until it answers), and the role's engines come back by themselves."""
        manager = self.manager
        return self.bound_s > 0 and bool(manager.lost) and not manager.serving()

    async def wait(self) -> None:
        """Until an engine of the role serves again; ``InferenceError`` 503 once the outage
        has lasted ``bound_s``."""
        if self.deadline is None:
            self.deadline = Deadline(self.bound_s)
            operator_log().warning(  # why each left is in the rank's log
                f"relax-launch: every {self.manager.role} engine is out of routing (dead or "
                f"restarting); its requests wait up to {self.bound_s:.0f} s for one to serve again"
            )
        deadline = self.deadline
        while not self.manager.serving():
            if deadline.passed:
                self.deadline = None  # a later outage gets a bound of its own
                raise InferenceError(
                    503,
                    f"no {self.manager.role} engine came back within {self.bound_s:.0f} s "
                    "(cluster.startup_timeout_s)",
                )
            await asyncio.sleep(min(self.poll_s, deadline.left()))
        if self.deadline is deadline:  # the first waiter back closes the outage
            self.deadline = None
            waited = deadline.timeout_s - deadline.left()
            operator_log().info(
                f"relax-launch: a {self.manager.role} engine serves again; its requests waited "
                f"{waited:.1f} s"
            )
