"""The engine side of a LoRA policy served as an adapter, unit by unit: the default adapter a
request gets, and the LoRA flags an engine is started with. (The whole path, with a real engine
and trainer, is ``tests/runtime/test_job.py``'s adapter case.)"""

from __future__ import annotations

from types import SimpleNamespace

from relax_launch.inference.policy_adapter import adapter_name, default_adapter
from relax_launch.inference.server import engine_cli_args
from relax_launch.runtime.workers import _lora_serving
from relax_launch.trainer.config import LoraConfig


def manager(*loaded: str, enabled: bool = True) -> SimpleNamespace:
    return SimpleNamespace(enable_lora=enabled, lora_ref_cache=dict.fromkeys(loaded))


def test_a_request_naming_no_adapter_gets_the_newest_policy_version():
    request = SimpleNamespace(lora_path=None)
    # v10 after v9: versions compare as numbers; other adapters are not the policy
    default_adapter(manager("policy-v9", "someone-else", "policy-v10"), request)
    assert request.lora_path == adapter_name(10) == "policy-v10"


def test_a_request_keeps_its_own_adapter_and_a_plain_engine_changes_nothing():
    named = SimpleNamespace(lora_path="someone-else")
    default_adapter(manager("policy-v3", "someone-else"), named)
    assert named.lora_path == "someone-else"
    plain = SimpleNamespace(lora_path=None)
    default_adapter(manager("policy-v3", enabled=False), plain)
    assert plain.lora_path is None
    before_first_sync = SimpleNamespace(lora_path=None)
    default_adapter(manager(), before_first_sync)
    assert before_first_sync.lora_path is None  # the base model, until a version is loaded


def test_an_adapter_engine_starts_with_sglang_lora_flags():
    lora = LoraConfig(rank=8, target_modules=("linear_qkv", "linear_fc2"), engines="adapter")
    args = engine_cli_args(_lora_serving(lora, "cpu"))
    assert args == [
        "--enable-lora",
        "--max-lora-rank", "8",
        "--lora-target-modules", "q_proj", "k_proj", "v_proj", "down_proj",
        "--max-loras-per-batch", "2",
        "--lora-backend", "torch_native",
    ]  # fmt: skip
    assert engine_cli_args({"json_model_override_args": {"a": 1}}) == [
        "--json-model-override-args",
        '{"a": 1}',
    ]
