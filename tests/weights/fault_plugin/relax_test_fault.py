"""Test-only SGLang plugin (found through this directory's dist-info when it is on the engines'
PYTHONPATH): one engine dies in the middle of a weight sync, as when it crashes.

With ``RELAX_TEST_FAULT_AT`` = V, the engine of rank ``$RELAX_TEST_FAULT_GROUP_RANK`` (default 2:
the second engine) in the broadcast group, asked for weight version V, writes
``$RELAX_TEST_FAULT_DIR/victim`` (once: the sync sent again is spared) and stops at once,
reading nothing (SIGSTOP): the trainer's broadcast fills the socket buffers towards it and
stalls, so the other engines have received part of the weights only. A helper process SIGKILLs
the victim's whole process group ``$RELAX_TEST_FAULT_KILL_S`` (default 3) seconds later.
Without ``RELAX_TEST_FAULT_AT`` it does nothing.

With ``RELAX_TEST_CORRUPT_AT`` = V, every engine that takes weight version V adds noise to
one of its parameters right after the update (an engine that took other weights than the
trainer sent, as a broken LoRA merge or layout would leave it): what the parity probe after
every sync (``runtime/parity_probe.py``) must catch. With ``RELAX_TEST_CORRUPT_HALF`` =
prefill or decode, only that half of a disaggregated pair is corrupted. Test-only: nothing
outside ``tests/`` reads the variables.
"""

from __future__ import annotations

import os
import signal
import subprocess

UPDATER = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if os.environ.get("RELAX_TEST_FAULT_AT"):
        HookRegistry.register(f"{UPDATER}.update_weights_from_distributed", die, HookType.AROUND)
    if os.environ.get("RELAX_TEST_CORRUPT_AT"):
        version_set = f"{UPDATER}.record_weight_version_after_update"
        HookRegistry.register(version_set, corrupt, HookType.AROUND)


def corrupt(original, manager, weight_version):
    """After the engine records ``weight_version``: noise on its first 2-D layer weight."""
    original(manager, weight_version)
    if weight_version != os.environ["RELAX_TEST_CORRUPT_AT"]:
        return
    half = os.environ.get("RELAX_TEST_CORRUPT_HALF")
    if half and manager.tp_worker.model_runner.server_args.disaggregation_mode != half:
        return
    import torch

    model = manager.tp_worker.model_runner.model
    name, weight = next(
        (n, p) for n, p in model.named_parameters() if "layers.0." in n and p.dim() == 2
    )
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(weight.shape, generator=generator, dtype=torch.float32)
    with torch.no_grad():
        weight.add_(noise.to(weight.device, weight.dtype) * weight.float().std() * 0.5)
    print(f"relax-test: corrupted {name} at weight version {weight_version}", flush=True)


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
