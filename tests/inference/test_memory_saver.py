"""Memory that SGLang's memory saver releases is really freed on the CPU.

The stand-in for ``torch_memory_saver`` is checked in-process (pages go back to the kernel,
backups restore exact bytes), then under a real SGLang engine that runs its unmodified
``release_memory_occupation``/``resume_memory_occupation`` path: the resident memory of the
engine's process tree drops by its weights and KV cache, and comes back, and greedy generation
after the round trip matches generation before it.
"""

from __future__ import annotations

import gc
import shutil
import weakref
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from relax_launch.inference.server import SGLangServer
from relax_launch.platform.stand_ins import torch_memory_saver as stand_in
from relax_launch.processes import group_alive

pytestmark = pytest.mark.e2e

MB = 2**20
TAGS = ["weights", "kv_cache"]
ENGINE_START_TIMEOUT_S = 240.0


def rss(pids: list[int] | None = None) -> int:
    """Resident bytes of this process, or of the given processes and all their children."""
    if pids is None:
        return psutil.Process().memory_info().rss
    procs = [psutil.Process(pid) for pid in pids]
    procs += [child for p in procs for child in p.children(recursive=True)]
    return sum(p.memory_info().rss for p in procs)


def test_stand_in_frees_pages_and_restores_backups(monkeypatch, tmp_path):
    monkeypatch.setenv(stand_in.BACKUP_DIR_ENV, str(tmp_path))
    saver = stand_in.TorchMemorySaver()
    outside = torch.arange(1000, dtype=torch.float32)
    with saver.region("weights", enable_cpu_backup=True):
        weight = torch.nn.Parameter(torch.empty(16 * MB))  # 64 MB, kept via the Parameter
        weight.data.uniform_()
        temporary = weakref.ref(torch.ones(1000).untyped_storage())
        outside.add_(1)  # in place on a storage the region did not allocate
    with saver.region("kv_cache"):
        cache = torch.full((16 * MB,), 7.0)
    gc.collect()
    assert temporary() is None, "the region kept a temporary alive"
    assert {t for t, _ in saver._owners.values()} == {"weights", "kv_cache"}
    assert len(saver._owners) == 2, "only the two live allocations belong to regions"
    expected, before = weight.detach().clone(), rss()

    saver.pause("weights")
    saver.pause("weights")  # idempotent
    assert before - rss() >= 0.9 * weight.nbytes
    assert len(list(tmp_path.iterdir())) == 1
    saver.pause("kv_cache")
    assert before - rss() >= 0.9 * (weight.nbytes + cache.nbytes)
    assert not weight.any() and not cache.any()  # the addresses stay valid and read as zeros

    saver.resume("weights")
    saver.resume("kv_cache")
    saver.resume("kv_cache")
    assert torch.equal(weight, expected), "the backup did not restore the exact bytes"
    assert not cache.any(), "without a backup the pages come back as zeros"
    assert torch.equal(outside, torch.arange(1, 1001, dtype=torch.float32))
    assert rss() >= before - 0.1 * (weight.nbytes + cache.nbytes), "resume re-reserves memory"
    assert not list(tmp_path.iterdir()), "the backup file outlived the resume"


@pytest.fixture(scope="module")
def measurable_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's tokenizer with a wider random body (~100 MB of fp32 weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("wide-llama")
    shutil.copytree(tiny_model, out, dirs_exist_ok=True)
    config = LlamaConfig.from_pretrained(tiny_model)
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = 768, 2048, 4
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 12, 4, 64
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


def greedy(url: str) -> tuple[list[int], list[float]]:
    reply = httpx.post(
        f"{url}/generate",
        json={
            "input_ids": [1, 2, 3, 4],
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        },
        timeout=60,
    ).json()
    return reply["output_ids"], [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]


def post(url: str, route: str, body: dict) -> None:
    httpx.post(f"{url}/{route}", json=body, timeout=120).raise_for_status()


def test_engine_release_frees_weights_and_kv_and_resume_restores_them(measurable_model, tmp_path):
    from transformers import LlamaConfig

    server = SGLangServer(
        model_path=measurable_model,
        device="cpu",
        log_path=tmp_path / "sglang.log",
        engine={
            "max_total_tokens": 16384,
            "random_seed": 0,
            "dtype": "float32",
            "enable_memory_saver": True,
            "enable_weights_cpu_backup": True,
        },
    )
    server.start(timeout_s=ENGINE_START_TIMEOUT_S)
    pid = server.pid
    try:
        url = server.url
        tokens = httpx.get(f"{url}/get_server_info", timeout=30).json()["max_total_num_tokens"]
        c = LlamaConfig.from_pretrained(measurable_model)
        kv_bytes = tokens * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4
        weight_bytes = sum(f.stat().st_size for f in measurable_model.glob("*.safetensors"))
        released_bytes = weight_bytes + kv_bytes
        first = greedy(url)

        before = rss([pid])
        post(url, "pause_generation", {"mode": "abort"})
        post(url, "flush_cache", {})
        post(url, "release_memory_occupation", {"tags": TAGS})
        released = rss([pid])
        post(url, "resume_memory_occupation", {"tags": TAGS})
        post(url, "continue_generation", {})
        resumed = rss([pid])
        print(
            f"engine tree RSS MB: before {before / MB:.0f}, released {released / MB:.0f}, "
            f"resumed {resumed / MB:.0f}; weights {weight_bytes / MB:.0f} + KV {kv_bytes / MB:.0f}"
        )
        assert before - released >= 0.9 * released_bytes
        assert resumed - released >= 0.9 * released_bytes
        assert greedy(url) == first, "weights restored from the backup changed generation"
    finally:
        server.stop()
    assert not group_alive(pid), f"SGLang processes of group {pid} outlived stop()"
