"""The ``rollout.environment`` section: an environment module (verifiers' contract: its
``load_environment(**args)`` returns an environment with a ``dataset``, an async ``rollout``
through an OpenAI-compatible client and a ``rubric``) that supplies the prompts, holds the
conversations and scores them (``rl/environments.py``)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from relax_launch.config.section import Section


class EnvironmentConfig(Section):
    """An environment module run in a process of its own, talking to the job over HTTP."""

    module: str = Field(
        pattern=r"^[A-Za-z_][\w.]*$",
        description="The environment's module (on PYTHONPATH of the interpreter below); its "
        "load_environment(**args) is called once, in a worker process.",
    )
    args: dict[str, Any] = Field(
        {}, description="Keyword arguments of load_environment (JSON values)."
    )
    python: str | None = Field(
        None,
        description="The interpreter of the environment's own virtualenv (e.g. one with "
        "verifiers and its dependencies, which clash with the job's pins); unset: the job's. "
        "Only the standard library, openai and the module are imported there.",
    )
    load_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Time the module may take to import and load its environment (a cold "
        "node's library import and dataset preparation can take minutes).",
    )
    rollout_timeout_s: float = Field(
        600.0, gt=0, description="Time one rollout (all its turns and its rubric) may take."
    )
