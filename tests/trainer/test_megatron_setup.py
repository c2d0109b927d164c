"""``platform.prepare_megatron`` on the CPU: Megatron's fused functions stay plain Python (its
default wraps them in torch.compile, which compiles C++ at a job's first steps and again for new
sequence lengths: 10-25 s of the first two steps, for nothing on the CPU), and calling it after
Megatron's model code was imported is refused rather than silently ineffective."""

from __future__ import annotations

import subprocess
import sys

PREPARED = """
from relax_launch import platform
{before}
platform.prepare_megatron("cpu")
"""
# torch.compile's wrapper keeps the function it compiles under this attribute
COMPILED = """
from megatron.core.fusions import fused_cross_entropy
print(hasattr(fused_cross_entropy.calculate_logits_max, "_torchdynamo_orig_callable"))
"""


def run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_fused_functions_are_not_compiled_on_the_cpu(venv_env):
    result = run(PREPARED.format(before="") + COMPILED, venv_env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"


def test_preparing_after_the_model_code_is_imported_is_refused(venv_env):
    result = run(
        PREPARED.format(before="import megatron.core.fusions.fused_cross_entropy"), venv_env
    )
    assert result.returncode != 0
    assert "prepare_megatron must run before" in result.stderr


def test_megatrons_default_compiles_them(venv_env):
    """The premise: imported without prepare_megatron, the function is a torch.compile wrapper."""
    result = run(COMPILED, venv_env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "True"
