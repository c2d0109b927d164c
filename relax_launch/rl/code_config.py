"""The ``reward.sources[].code`` section: how ``builtin:code_tests`` finds the candidate program
in a response and the limits of the sandbox it runs in (``rl/code_pool.py``). The wall time of
one sample (all its tests) is the source's ``timeout_s``."""

from __future__ import annotations

from pydantic import Field, field_validator

from relax_launch.config.patterns import checked_pattern
from relax_launch.config.section import Section

CODE_PATTERN = r"```(?:py(?:thon3?)?)?[ \t]*\n(.*?)```"  # ```, ```py, ```python, ```python3


class CodeTestsConfig(Section):
    """The sandbox of builtin:code_tests: its program extraction and its limits."""

    code_pattern: str = Field(
        CODE_PATTERN,
        description="Regex whose first group, at its last match in the response, is the "
        "program (default: the last ```python block). No match: reward 0.",
    )
    cpu_s: float = Field(
        4.0, gt=0, description="CPU seconds of the test runner (RLIMIT_CPU, rounded up)."
    )
    memory_mb: int = Field(
        512, ge=64, description="Address space of each sandbox process, MiB (RLIMIT_AS)."
    )
    disk_mb: int = Field(
        16,
        ge=1,
        description="Size of the sandbox's /tmp, its only writable place (a tmpfs), and the "
        "largest file it may write (RLIMIT_FSIZE), MiB.",
    )
    processes: int = Field(
        8, ge=1, description="Processes and threads the sandbox's uid may have (RLIMIT_NPROC)."
    )
    output_kb: int = Field(
        64,
        ge=1,
        description="Output one test may print; beyond it that test fails. Writes around "
        "sys.stdout go to /dev/null.",
    )
    concurrency: int = Field(
        4, ge=1, le=64, description="Sandboxes run at once (each takes a uid, below)."
    )
    uid: int = Field(
        62000,
        ge=1000,
        le=2**31 - 1 - 64,
        description="Sandbox k of those running at once runs as uid and gid uid + k: ids no "
        "account of the machine uses, so its files and process count are its own.",
    )

    @field_validator("code_pattern")
    @classmethod
    def _one_group(cls, pattern: str) -> str:
        return checked_pattern(pattern, "code_pattern", "program")
