"""SGLang's HTTP server (``sglang.launch_server``) with its scheduler and detokenizer processes
forked instead of spawned: how a CPU engine starts (``platform.sglang_server_module``).

SGLang spawns its subprocesses (``mp.set_start_method("spawn", force=True)``) because a forked
child cannot use CUDA its parent initialised. A CPU engine has no CUDA, and each spawned child
imports SGLang and torch all over again: 8-10 core-seconds each, measured on the tiny Llama,
where the whole server takes 26 to come up. Forked, the children inherit the parent's imports
(and the plugins it loaded, the weight-sync receiver among them): 10-11 core-seconds in all.
Only the main thread runs when SGLang forks them, so no lock is copied held. On GPUs the
server starts as SGLang ships it.
"""

from __future__ import annotations

import multiprocessing
import runpy

_set_start_method = multiprocessing.set_start_method


def _fork_where_spawn_is_asked(method: str | None, force: bool = False) -> None:
    _set_start_method("fork" if method == "spawn" else method, force=force)


if __name__ == "__main__":
    multiprocessing.set_start_method = _fork_where_spawn_is_asked
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
