"""Test-only SGLang plugin (found through this directory's dist-info when it is on the engines'
PYTHONPATH): one engine dies in the middle of a weight sync, as when it crashes.

With ``RELAX_TEST_FAULT_AT`` = V, the engine of rank ``$RELAX_TEST_FAULT_GROUP_RANK`` (default 2:
the second engine) in the broadcast group, asked for weight version V, writes
``$RELAX_TEST_FAULT_DIR/victim`` (once: the sync sent again is spared) and stops at once,
reading nothing (SIGSTOP): the trainer's broadcast fills the socket buffers towards it and
stalls, so the other engines have received part of the weights only. A helper process SIGKILLs
the victim's whole process group ``$RELAX_TEST_FAULT_KILL_S`` (default 3) seconds later.
Without ``RELAX_TEST_FAULT_AT`` it does nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess

UPDATER = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"


def register() -> None:
    if not os.environ.get("RELAX_TEST_FAULT_AT"):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{UPDATER}.update_weights_from_distributed", die, HookType.AROUND)


def die(original, manager, request):
    updater = manager.tp_worker.model_runner.weight_updater
    rank = updater._model_update_group[request.group_name].rank()
    chosen = rank == int(os.environ.get("RELAX_TEST_FAULT_GROUP_RANK", "2"))
    if request.weight_version == os.environ["RELAX_TEST_FAULT_AT"] and chosen and _first():
        delay = os.environ.get("RELAX_TEST_FAULT_KILL_S", "3")
        group = os.getpgid(0)
        subprocess.Popen(["sh", "-c", f"sleep {delay}; kill -9 -{group}"], start_new_session=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    return original(manager, request)


def _first() -> bool:
    """True for the first engine to get here only."""
    victim = os.path.join(os.environ["RELAX_TEST_FAULT_DIR"], "victim")
    try:
        os.close(os.open(victim, os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False
