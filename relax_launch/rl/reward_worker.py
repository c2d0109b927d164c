"""A scoring worker (``python -m relax_launch.rl.reward_worker PARENT_PID``), started by
``rl/reward_pool.py``: it imports the scorers once, says it is ready, then answers one call at a
time. Frames (``rl/reward_frames.py``) on stdin/stdout: ``(kind, args)`` in, ``("ok", value)``
or ``("error", message)`` out; the first frame out is ``("ready", None)``. It dies with its
parent (Linux PDEATHSIG), so no worker outlives the job."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

from relax_launch.rl import math_reward, reasoning_gym_tasks
from relax_launch.rl.reward_frames import read_frame, write_frame

KINDS: dict[str, Callable[..., float]] = {
    "math_verify": math_reward.score,
    "reasoning_gym": reasoning_gym_tasks.score,
}
PR_SET_PDEATHSIG = 1


def die_with(parent: int) -> None:
    """SIGKILL this worker when its parent dies, even by SIGKILL (Linux). Strictly when the
    parent's thread that started it ends: the main thread, or an off-policy step's rollout
    thread, which lives until the job's end (a worker lost earlier is replaced)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(0)


def main() -> None:
    die_with(int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the job; the pool stops us
    inbox, outbox = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a scorer's prints must not corrupt the frames
    # sympy and math-verify import more on their first call: not inside a sample's time limit
    math_reward.score(r"\boxed{\frac{1}{2}}", "0.5")
    write_frame(outbox, ("ready", None))
    while (call := read_frame(inbox)) is not None:
        kind, args = call
        try:
            write_frame(outbox, ("ok", float(KINDS[kind](*args))))
        except Exception as exc:  # noqa: BLE001 - reported to the pool as this sample's failure
            write_frame(outbox, ("error", f"{type(exc).__name__}: {exc}"))


if __name__ == "__main__":
    main()
