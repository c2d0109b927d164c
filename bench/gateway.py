"""Benchmark: what the gateway adds on the way to an engine, against sglang-router.

One upstream, reached three ways in the same run, which take turns: directly, through
relax-launch's gateway (uvicorn thread of this process, as on rank 0) and through sglang-router
(Rust, a process of its own). Two upstreams:
  echo    a minimal HTTP server answering a fixed JSON body (isolates the proxy's own cost)
  engine  a real SGLang CPU engine serving the tiny Llama, one new token per request
The upstreams and the load generator are processes of their own, as engines and clients are
for a job: nothing else shares the gateway's interpreter (``--in-process`` puts the echo
server and the load generator back in it, as this bench did until 2026-12-05).
Prints p50/p99 latency of sequential requests (keep-alive), the p50 added over direct, and
requests/s with 16 concurrent clients. There is no "added p99": a difference of two separately
measured p99s is not a percentile of anything (it can come out negative).
Run: ``.venv/bin/python bench/gateway.py [--requests N] [--in-process]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import httpx
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
ROUNDS = 5  # turns per path of the throughput measurement
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


def start_echo() -> tuple[uvicorn.Server, str]:
    config = uvicorn.Config(echo_app, host="127.0.0.1", port=0, log_level="error", http="httptools")
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


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


async def _throughput(url: str, seconds: float) -> tuple[int, float]:
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


def throughputs(urls: dict[str, str], seconds: float) -> dict[str, float]:
    """Requests/s of each path over ``seconds``, in ``ROUNDS`` turns (as for ``latencies``)."""
    done = dict.fromkeys(urls, 0)
    took = dict.fromkeys(urls, 0.0)
    for _ in range(ROUNDS):
        for way, url in urls.items():
            n, s = asyncio.run(_throughput(url, seconds / ROUNDS))
            done[way], took[way] = done[way] + n, took[way] + s
    return {way: done[way] / took[way] for way in urls}


def load(urls: dict[str, str], requests: int, seconds: float) -> tuple[dict, dict]:
    """Both measurements, from this process: (latencies, requests/s) per path."""
    return latencies(urls, requests), throughputs(urls, seconds)


def load_elsewhere(urls: dict[str, str], requests: int, seconds: float) -> tuple[dict, dict]:
    """``load`` run by a process of its own (``--load``), its results read back."""
    spec = json.dumps({"urls": urls, "requests": requests, "seconds": seconds})
    done = subprocess.run(
        [sys.executable, __file__, "--load", spec], capture_output=True, text=True, check=True
    )
    lat, rps = json.loads(done.stdout.splitlines()[-1])
    return lat, rps


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if q < 100 else max(values)


def measure(
    name: str, upstream: str, requests: int, seconds: float, log_dir: Path, in_process: bool
) -> None:
    gateway = start_gateway(upstream)
    router = SGLangRouter(
        worker_urls=[upstream], log_path=log_dir / f"router-{name}.log", policy="round_robin"
    )
    router.start(120)
    paths = {
        "direct": upstream + "/generate",
        "gateway": gateway.url + "/teacher/generate",
        "sglang-router": router.url + "/generate",
    }
    try:
        measured = load if in_process else load_elsewhere
        lat, rps = measured(paths, requests, seconds)
        rows = {
            way: (percentile(lat[way], 50), percentile(lat[way], 99), rps[way]) for way in paths
        }
    finally:
        router.stop()
        gateway.stop()
    base50 = rows["direct"][0]
    print(
        f"\nupstream: {name} ({requests} sequential requests, "
        f"{CONCURRENCY} concurrent for {seconds:.0f} s)"
    )
    print(f"  {'path':<14} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'req/s':>8}")
    for way, (p50, p99, rps) in rows.items():
        print(
            f"  {way:<14} {p50 * 1e3:8.2f} {p99 * 1e3:8.2f} {(p50 - base50) * 1e3:8.2f} {rps:8.0f}"
        )
    ratio = rows["gateway"][2] / rows["sglang-router"][2]
    print(f"  gateway throughput / sglang-router throughput = {ratio:.2f} (target {TARGETS[name]})")
    print(f"  gateway added p50 = {(rows['gateway'][0] - base50) * 1e3:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--in-process", action="store_true", help="upstream and load in here")
    parser.add_argument("--echo", type=int, help=argparse.SUPPRESS)  # a child: echo server
    parser.add_argument("--load", help=argparse.SUPPRESS)  # a child: load generator
    args = parser.parse_args()
    if args.echo:
        return serve_echo(args.echo)
    if args.load:
        spec = json.loads(args.load)
        return print(json.dumps(load(spec["urls"], spec["requests"], spec["seconds"])))
    print(
        "layout:",
        "in process" if args.in_process else "upstream and load in processes of their own",
    )
    with tempfile.TemporaryDirectory() as logs:
        run_echo(args, Path(logs))
        engine = SGLangServer(
            model_path=ensure_model("builtin:tiny-llama"),
            device="cpu",
            log_path=Path(logs) / "engine.log",
            engine={"max_total_tokens": 2048},
        )
        engine.start(300)
        try:
            measure(
                "engine", engine.url, args.requests // 3, args.seconds, Path(logs), args.in_process
            )
        finally:
            engine.stop()


def run_echo(args: argparse.Namespace, logs: Path) -> None:
    if args.in_process:
        echo, url = start_echo()
        try:
            measure("echo", url, args.requests, args.seconds, logs, True)
        finally:
            echo.should_exit = True
        return
    process, url = start_echo_process()
    try:
        measure("echo", url, args.requests, args.seconds, logs, False)
    finally:
        process.kill()
        process.wait(10)


if __name__ == "__main__":
    main()
