"""Benchmark: prefill/decode disaggregation against plain engines, on the same ranks and requests.

Two SGLang engines serve SmolLM2-135M (or ``--model``) behind relax-launch's gateway, first as
two plain engines (requests in turn), then as one prefill engine and one decode engine (each
request prefilled on one, its KV cache moved by Mooncake over TCP, decoded on the other). Each
engine computes with ``--threads`` threads. The requests are an agentic turn's shape: a long
system prompt shared by every request, a short question of its own and a short answer
(``--answer`` tokens, greedy, to the end), ``--concurrency`` in flight, streamed. Prints, per
setup: requests/s and output tokens/s over the whole run, and the median and p90 time to the
first token and time between tokens; then PD over plain.

Run: ``.venv/bin/python bench/pd.py [--requests N] [--concurrency C] [--model builtin:NAME]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

from relax_launch import platform
from relax_launch.inference.config import GatewayConfig
from relax_launch.inference.discovery import RoutingSpec, WeightSource
from relax_launch.inference.engine import EngineHandle
from relax_launch.inference.gateway import InferenceGateway
from relax_launch.inference.manager import InferenceManager
from relax_launch.inference.serve import GatewayServer
from relax_launch.inference.server import SGLangServer
from relax_launch.models.build import ensure_model

SYSTEM = (
    "You are a careful assistant for arithmetic word problems. Read the question, work out the "
    "quantities involved, check each intermediate result, and answer with the final number "
    "only, in the format <answer>N</answer>. "
)


def servers(model: Path, halves: list[str | None], threads: int, logs: Path) -> list[SGLangServer]:
    return [
        SGLangServer(
            model_path=model,
            device="cpu",
            log_path=logs / f"engine{i}-{half or 'plain'}.log",
            engine={"max_total_tokens": 16384, "dtype": "float32", "log_level": "warning"},
            extra_env=platform.thread_env("cpu", threads),
            disaggregation_half=half,
        )
        for i, half in enumerate(halves)
    ]


def manager_of(engines: list[SGLangServer]) -> InferenceManager:
    manager = InferenceManager(
        role="rollout",
        model_id="m",
        served_model_name="m",
        weight_source=WeightSource.TRAINER,
        routing=RoutingSpec(default_model="m"),
    )
    handles = [
        EngineHandle(f"m/{i}", e.url, role="rollout", static=False, half=e.half)
        for i, e in enumerate(engines)
    ]
    for handle, engine in zip(handles, engines, strict=True):
        handle.bootstrap_port = engine.bootstrap_port
        if engine.half == "decode":
            handle.prefill_id = next(h.engine_id for h in handles if h.half == "prefill")
    manager.attach(handles)
    manager.weights_valid = True  # served as loaded: no trainer here
    return manager


async def one(
    session: aiohttp.ClientSession, url: str, question: int, answer: int, system: str
) -> dict:
    """One streamed request: when it was sent, its first token came, each later chunk came."""
    body = {
        "text": system + f"Question {question}: what is {question} times {question + 3}?",
        "sampling_params": {"max_new_tokens": answer, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    sent, arrivals, tokens = time.perf_counter(), [], 0
    async with session.post(url, data=orjson.dumps(body)) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: {"):
                arrivals.append(time.perf_counter())
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"the engine failed the request: {chunk['error']}")
                tokens = chunk["meta_info"]["completion_tokens"]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {"ttft": arrivals[0] - sent, "gaps": gaps, "tokens": tokens}


async def load(
    url: str, requests: int, concurrency: int, answer: int, system: str
) -> tuple[float, list]:
    queue = list(range(requests))
    results: list[dict] = []

    async def client(session: aiohttp.ClientSession) -> None:
        while queue:
            results.append(await one(session, url, queue.pop(), answer, system))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await one(session, url, -1, answer, system)  # warm-up: the shared prompt enters the caches
        began = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        return time.perf_counter() - began, results


def measure(name: str, halves: list[str | None], args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as logs:
        engines = servers(ensure_model(args.model), halves, args.threads, Path(logs))
        try:
            for engine in engines:
                engine.launch()
            for engine in engines:
                engine.wait_ready(600)
            gateway = GatewayServer(
                InferenceGateway(
                    {"rollout": manager_of(engines)}, config=GatewayConfig(), admin_token=None
                ),
                "127.0.0.1",
                0,
            )
            gateway.start()
            try:
                url = f"{gateway.url}/rollout/generate"
                system = SYSTEM * args.system_repeat
                seconds, results = asyncio.run(
                    load(url, args.requests, args.concurrency, args.answer, system)
                )
            finally:
                gateway.stop()
        finally:
            for engine in engines:
                engine.stop()
    ttft = sorted(r["ttft"] for r in results)
    gaps = sorted(g for r in results for g in r["gaps"])
    figures = {
        "requests/s": len(results) / seconds,
        "tokens/s": sum(r["tokens"] for r in results) / seconds,
        "ttft p50 ms": 1000 * statistics.median(ttft),
        "ttft p90 ms": 1000 * ttft[int(0.9 * (len(ttft) - 1))],
        "itl p50 ms": 1000 * statistics.median(gaps),
        "itl p90 ms": 1000 * gaps[int(0.9 * (len(gaps) - 1))],
    }
    print(f"{name:>16}: " + "  ".join(f"{k} {v:8.2f}" for k, v in figures.items()), flush=True)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--answer", type=int, default=16, help="tokens per answer")
    parser.add_argument(
        "--system-repeat", type=int, default=12, help="copies of the system prompt's paragraph"
    )
    parser.add_argument("--threads", type=int, default=max(1, platform.node_cores() // 2))
    args = parser.parse_args()
    print(
        f"{args.requests} requests, {args.concurrency} in flight, a shared system prompt of "
        f"{len(SYSTEM * args.system_repeat)} characters, "
        f"{args.answer}-token answers; {args.model}; {args.threads} threads per engine"
    )
    plain = measure("2 plain engines", [None, None], args)
    pd = measure("1 prefill + 1 decode", ["decode", "prefill"], args)
    print(f"{'PD / plain':>16}: " + "  ".join(f"{k} {pd[k] / plain[k]:8.2f}" for k in plain))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
