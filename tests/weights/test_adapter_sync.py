"""The adapter sync's own logic, with a recorded stand-in for the engines' HTTP routes: an engine
that refuses the adapter fails the sync naming it; a version sent again first drops its earlier
copy; the stages' files become one PEFT adapter. (Real engines: ``tests/runtime/test_job.py``'s
adapter case.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from relax_launch.inference.engine import EngineRequestError
from relax_launch.weights.adapter_sync import ADAPTER_FILE, load_everywhere, publish
from relax_launch.weights.update_session import EngineTarget, WeightSyncError


class Engines:
    """Answers like SGLang's LoRA routes; ``refuse``: engine URLs that fail to load."""

    def __init__(self, refuse: tuple[str, ...] = ()) -> None:
        self.refuse, self.calls = refuse, []

    def post(self, url: str, path: str, body: dict, timeout_s: float) -> dict:
        self.calls.append((url, path, body.get("lora_name") or body.get("new_version")))
        if path == "/unload_lora_adapter":
            raise EngineRequestError("adapter not loaded")  # nothing of that name yet
        if path == "/load_lora_adapter" and url in self.refuse:
            return {"success": False, "error_message": "rank 16 exceeds max_lora_rank 8"}
        return {"success": True}


TARGETS = [EngineTarget(f"http://e{i}", i, f"rollout engine {i} (rank {2 + i})", 1) for i in (0, 1)]


def test_every_engine_loads_the_version_after_dropping_any_earlier_copy(tmp_path):
    engines = Engines()
    load_everywhere(engines, TARGETS, tmp_path, 3, 30)
    for url in ("http://e0", "http://e1"):
        mine = [(path, what) for u, path, what in engines.calls if u == url]
        assert mine == [
            ("/unload_lora_adapter", "policy-v3"),  # a repair sends the same version again
            ("/load_lora_adapter", "policy-v3"),
            ("/update_weight_version", "3"),
        ]


def test_an_engine_that_refuses_the_adapter_fails_the_sync_naming_it(tmp_path):
    with pytest.raises(WeightSyncError, match=r"rollout engine 1 \(rank 3\).*max_lora_rank"):
        load_everywhere(Engines(refuse=("http://e1",)), TARGETS, tmp_path, 3, 30)


def test_the_stages_files_become_one_peft_adapter(tmp_path):
    save_file({"a.lora_A.weight": torch.ones(2, 3)}, str(tmp_path / "s0.safetensors"))
    save_file({"b.lora_B.weight": torch.zeros(4, 2)}, str(tmp_path / "s1.safetensors"))
    nbytes = publish(tmp_path, ["s0.safetensors", "s1.safetensors", "s1.safetensors"], {"r": 2})
    assert nbytes == (6 + 8) * 4
    assert sorted(load_file(str(tmp_path / ADAPTER_FILE))) == ["a.lora_A.weight", "b.lora_B.weight"]
    assert json.loads((tmp_path / "adapter_config.json").read_text()) == {"r": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [ADAPTER_FILE, "adapter_config.json"]
    )
