"""Benchmark: what the gateway adds on the way to an engine, against sglang-router.

One upstream, reached three ways in the same run, which take turns: directly, through
relax-launch's gateway (uvicorn thread of this process, as on rank 0) and through sglang-router
(Rust, a process of its own). Two upstreams:
  echo    a minimal HTTP server answering a fixed JSON body (isolates the proxy's own cost)
  engine  a real SGLang CPU engine serving the tiny Llama, one new token per request
The upstreams and the load generator are processes of their own, as engines and clients are
for a job: nothing else shares the gateway's interpreter.
Prints p50/p99 latency of sequential requests (keep-alive) and the p50 added over direct; then,
with 16 concurrent clients in ``ROUNDS`` turns per path, requests/s and the CPU each process
spent per request (the proxy's, and the upstream's: on a machine the engine saturates, the
proxy's CPU is taken from the engine). The throughput ratio is the median of the per-turn
ratios, with their range: single turns on a shared machine vary by more than the proxies
differ. There is no "added p99": a difference of two separately measured p99s is not a
percentile of anything (it can come out negative).
Run: ``.venv/bin/python bench/gateway.py [--requests N] [--seconds S]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import psutil
import uvicorn

from relax_launch.inference.config import GatewayConfig
from relax_launch.inference.discovery import RoutingSpec, WeightSource
from relax_launch.inference.engine import EngineHandle
from relax_launch.inference.gateway import InferenceGateway
from relax_launch.inference.manager import InferenceManager
from relax_launch.inference.process import free_port
from relax_launch.inference.router import SGLangRouter
from relax_launch.inference.serve import GatewayServer
from relax_launch.inference.server import SGLangServer
from relax_launch.models.build import ensure_model

BODY = {"text": "Hello there", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
CONCURRENCY = 16
ROUNDS = 8  # turns per path of the throughput measurement
ECHO_REPLY = b'{"text": "x", "meta_info": {"completion_tokens": 1}}'
# gateway req/s over sglang-router's; over echo, also the gateway's added p50 <= 0.5 ms
TARGETS = {"echo": ">= 0.40", "engine": ">= 1.0"}


async def echo_app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": ECHO_REPLY})


def serve_echo(port: int) -> None:
    """The echo upstream as a process of its own (``--echo PORT``)."""
    uvicorn.run(echo_app, host="127.0.0.1", port=port, log_level="error", http="httptools")


def start_echo_process() -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, __file__, "--echo", str(port)])
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 30
    while True:
        try:
            httpx.post(url + "/generate", json=BODY).raise_for_status()
            return process, url
        except httpx.HTTPError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise SystemExit(f"the echo server did not start on {url}") from None
            time.sleep(0.1)


def start_gateway(upstream: str) -> GatewayServer:
    manager = InferenceManager(
        role="teacher",
        model_id="m",
        served_model_name="m",
        weight_source=WeightSource.STATIC,
        routing=RoutingSpec(default_model="m"),
    )
    manager.attach([EngineHandle("m/0", upstream, role="teacher", static=True)])
    app = InferenceGateway({"teacher": manager}, config=GatewayConfig(), admin_token=None)
    server = GatewayServer(app, "127.0.0.1", 0)
    server.start()
    return server


def latencies(urls: dict[str, str], n: int) -> dict[str, list[float]]:
    """``n`` sequential requests per path, the paths taking turns: load that comes and goes on
    a shared machine then falls on every path alike."""
    with httpx.Client() as client:
        for url in urls.values():
            for _ in range(20):  # warm-up: connections, caches
                client.post(url, json=BODY).raise_for_status()
        out: dict[str, list[float]] = {way: [] for way in urls}
        for _ in range(n):
            for way, url in urls.items():
                started = time.perf_counter()
                client.post(url, json=BODY).raise_for_status()
                out[way].append(time.perf_counter() - started)
    return out


async def concurrent_load(url: str, seconds: float) -> tuple[int, float]:
    """(requests done, seconds taken) by ``CONCURRENCY`` clients posting for ``seconds``."""
    done = 0
    deadline = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONCURRENCY)) as s:

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                async with s.post(url, json=BODY) as r:
                    await r.read()
                    assert r.status == 200, r.status
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        return done, time.perf_counter() - started


def in_child(*args: str) -> object:
    """This script run as a load generator of its own (``--load`` / ``--latency``)."""
    done = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and every process under it; of this process (the
    gateway's), only its own: the upstream and the router are its children."""
    root = psutil.Process(pid)
    total = 0.0
    for process in [root, *(root.children(recursive=True) if pid != os.getpid() else [])]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def throughputs(urls: dict[str, str], seconds: float, pids: dict[str, int]) -> dict:
    """Per path: requests/s of each turn, and the CPU per request of each process in ``pids``
    over all turns (``ROUNDS`` turns, the paths in turn, as for ``latencies``)."""
    rates: dict[str, list[float]] = {way: [] for way in urls}
    cpu = {way: dict.fromkeys(pids, 0.0) for way in urls}
    done = dict.fromkeys(urls, 0)
    for _ in range(ROUNDS):
        for way, url in urls.items():
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            n, took = in_child("--load", url, str(seconds / ROUNDS))
            for name, pid in pids.items():
                cpu[way][name] += cpu_seconds(pid) - before[name]
            rates[way].append(n / took)
            done[way] += n
    per_request = {way: {k: v / done[way] for k, v in cpu[way].items()} for way in urls}
    return {"rates": rates, "cpu_per_request": per_request}


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if q < 100 else max(values)


def measure(name: str, upstream: str, pid: int, requests: int, seconds: float, logs: Path) -> None:
    gateway = start_gateway(upstream)
    router = SGLangRouter(
        worker_urls=[upstream], log_path=logs / f"router-{name}.log", policy="round_robin"
    )
    router.start(120)
    paths = {
        "direct": upstream + "/generate",
        "gateway": gateway.url + "/teacher/generate",
        "sglang-router": router.url + "/generate",
    }
    pids = {name: pid, "gateway": os.getpid(), "router": router.pid}
    try:
        lat = in_child("--latency", json.dumps(paths), str(requests))
        load = throughputs(paths, seconds, pids)
    finally:
        router.stop()
        gateway.stop()
    report(name, requests, seconds, lat, load)


def report(name: str, requests: int, seconds: float, lat: dict, load: dict) -> None:
    base50 = percentile(lat["direct"], 50)
    print(
        f"\nupstream: {name} ({requests} sequential requests; {CONCURRENCY} concurrent, "
        f"{ROUNDS} turns of {seconds / ROUNDS:.1f} s per path)"
    )
    cpu = load["cpu_per_request"]
    names = list(next(iter(cpu.values())))
    print(
        f"  {'path':<14} {'p50 ms':>7} {'p99 ms':>7} {'+p50 ms':>7} {'req/s':>7}  CPU µs/request: "
        + "  ".join(names)
    )
    for way, times in lat.items():
        p50, p99 = percentile(times, 50), percentile(times, 99)
        rate = statistics.median(load["rates"][way])
        spent = "  ".join(f"{cpu[way][k] * 1e6:>{len(k)}.0f}" for k in names)
        print(
            f"  {way:<14} {p50 * 1e3:7.2f} {p99 * 1e3:7.2f} {(p50 - base50) * 1e3:7.2f} "
            f"{rate:7.0f}                  {spent}"
        )
    turns = zip(load["rates"]["gateway"], load["rates"]["sglang-router"], strict=True)
    ratios = [gateway / router for gateway, router in turns]
    print(
        f"  gateway req/s ÷ sglang-router req/s, median of {ROUNDS} turns = "
        f"{statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f}; "
        f"target {TARGETS[name]})"
    )
    print(f"  gateway added p50 = {(percentile(lat['gateway'], 50) - base50) * 1e3:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=8.0, help="per path, echo upstream")
    parser.add_argument("--echo", type=int, help=argparse.SUPPRESS)  # a child: echo server
    parser.add_argument("--load", nargs=2, help=argparse.SUPPRESS)  # a child: one turn
    parser.add_argument("--latency", nargs=2, help=argparse.SUPPRESS)  # a child: latencies
    args = parser.parse_args()
    if args.echo:
        return serve_echo(args.echo)
    if args.load:
        return print(json.dumps(asyncio.run(concurrent_load(args.load[0], float(args.load[1])))))
    if args.latency:
        return print(json.dumps(latencies(json.loads(args.latency[0]), int(args.latency[1]))))
    with tempfile.TemporaryDirectory() as logs:
        process, url = start_echo_process()
        try:
            measure("echo", url, process.pid, args.requests, args.seconds, Path(logs))
        finally:
            process.kill()
            process.wait(10)
        engine = SGLangServer(
            model_path=ensure_model("builtin:tiny-llama"),
            device="cpu",
            log_path=Path(logs) / "engine.log",
            engine={"max_total_tokens": 2048},
        )
        engine.start(300)
        try:  # twice the time: the engine's rates vary more than the echo server's
            measure(
                "engine", engine.url, engine.pid, args.requests // 3, 2 * args.seconds, Path(logs)
            )
        finally:
            engine.stop()


if __name__ == "__main__":
    main()
