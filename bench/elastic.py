"""Benchmark: how long an elastic judge replica takes to serve, against a bare engine's start.

Runs ``relax-launch run tests/rl/elastic_tiny.yaml`` (one genrm engine, a rank reserved for a
second: ``genrm.max_engines: 2``; autoscaler off) and, while it trains and ``--workers`` threads
send judge requests (16 new tokens) to its gateway, ``--repeats`` times:

- ``POST /genrm/scale_out`` to 2, then ``GET /genrm/admin/engines`` every 0.1 s until the new
  engine's ``answered`` grows: seconds from the POST to its first served judge request (the
  gateway's or the controller's), to within a poll; also the operation's own ``seconds`` and its
  replica's (launch to first token, then ``/health``). Then ``POST /genrm/scale_in`` back to 1.

Then, job and stream still running (both compete for the same cores), ``--repeats`` bare starts
of the same engine (``SGLangServer``, the config's genrm engine arguments), launch to first
token. Prints each, the medians, scale-out ÷ bare, and the cores the job, this bench (stream,
bare engines) and others kept busy in each phase. The job ends by SIGTERM (exit 75: stopped).
Run: ``.venv/bin/python bench/elastic.py [--repeats 2] [--workers 2] [--model M] [--logs DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from relax_launch.config import load_config
from relax_launch.inference.server import SGLangServer
from relax_launch.models.build import ensure_model
from relax_launch.run_dir import EXIT_STOPPED

CONFIG = Path(__file__).resolve().parent.parent / "tests" / "rl" / "elastic_tiny.yaml"
TOKEN = secrets.token_hex(16)
PROMPT = [{"role": "user", "content": "Is 2 + 3 = 5? Answer with a score."}]
JUDGE = {"messages": PROMPT, "sampling_params": {"max_new_tokens": 16}}
ADMIN = httpx.Client(headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
POLL_S = 0.1
TIMEOUT_S = 400.0  # one scale operation, or the job to come up


class Stream:
    """``workers`` threads sending judge requests to the gateway until ``stop``."""

    def __init__(self, gateway: str, workers: int) -> None:
        self.gateway, self.answered, self.failures = gateway, 0, []
        self._stop, self._lock = threading.Event(), threading.Lock()
        self.threads = [threading.Thread(target=self._send, daemon=True) for _ in range(workers)]
        for thread in self.threads:
            thread.start()

    def _send(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                try:
                    reply = client.post(f"{self.gateway}/genrm/generate", json=JUDGE)
                    ok, why = reply.status_code == 200, f"{reply.status_code} {reply.text[:200]}"
                except httpx.HTTPError as exc:
                    ok, why = False, f"{type(exc).__name__}: {exc}"
                with self._lock:
                    self.answered += ok
                    self.failures += [] if ok else [why]

    def stop(self) -> None:
        self._stop.set()
        for thread in self.threads:
            thread.join(timeout=150)


class Cpu:
    """Cores kept busy between marks: in all, by the job's process tree, by this process's (the
    stream and bare engines), and by the rest (others); tree CPU times polled every 0.25 s."""

    def __init__(self, job: int) -> None:
        self.roots = {"job": psutil.Process(job), "bench": psutil.Process()}
        self.seen: dict[str, dict[int, float]] = {name: {} for name in self.roots}
        self._stop = threading.Event()
        self._poll()
        self.last = self._totals()
        threading.Thread(target=self._run, daemon=True).start()

    def _poll(self) -> None:
        for name, root in self.roots.items():  # the job first: the bench's tree holds it too
            with contextlib.suppress(psutil.Error):
                for process in [root, *root.children(recursive=True)]:
                    if name == "bench" and process.pid in self.seen["job"]:
                        continue
                    with contextlib.suppress(psutil.Error):
                        times = process.cpu_times()
                        self.seen[name][process.pid] = times.user + times.system

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            self._poll()

    def _totals(self) -> dict[str, float]:
        times = psutil.cpu_times()
        busy = sum(times) - times.idle - getattr(times, "iowait", 0.0)
        trees = {name: sum(seen.values()) for name, seen in self.seen.items()}
        return {"wall": time.monotonic(), "busy": busy, **trees}

    def mark(self) -> dict[str, float]:
        """Cores busy since the last mark: busy, job, bench, others."""
        self._poll()
        now = self._totals()
        wall = now["wall"] - self.last["wall"]
        cores = {k: (now[k] - self.last[k]) / wall for k in ("busy", "job", "bench")}
        self.last = now
        return cores | {"others": max(0.0, cores["busy"] - cores["job"] - cores["bench"])}


def gateway_of(run_dir: Path, job: subprocess.Popen) -> str:
    """The job's gateway URL, once every role serves."""
    record, url, deadline = run_dir / "gateway.json", None, time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if job.poll() is not None:
            raise RuntimeError(f"the job exited ({job.returncode}) before it was ready")
        if url is None and record.is_file():
            url = json.loads(record.read_text())["url"]
        if url and httpx.get(f"{url}/ready", timeout=10).status_code == 200:
            return url
        time.sleep(0.5)
    raise TimeoutError(f"the job not ready within {TIMEOUT_S:.0f} s")


def engines(gateway: str) -> dict[int, dict]:
    reply = ADMIN.get(f"{gateway}/genrm/admin/engines")
    reply.raise_for_status()
    return {r["index"]: r for r in reply.json()["replicas"]}


def operate(gateway: str, kind: str, replicas: int) -> tuple[float, str]:
    """(monotonic time of the POST, request id) of a scale operation to ``replicas``."""
    began = time.monotonic()
    reply = ADMIN.post(f"{gateway}/genrm/{kind}", json={"num_replicas": replicas})
    if reply.status_code != 202:
        raise RuntimeError(f"{kind}: {reply.status_code} {reply.text[:500]}")
    return began, reply.json()["request_id"]


def follow(gateway: str, kind: str, posted: float, request_id: str, index: int):
    """Poll until the operation ended and (scale-out) engine ``index`` answered a request: (its
    document, seconds from ``posted`` to that answer). A started server's count starts at 0."""
    served, doc = None, {"state": "running"}
    while time.monotonic() - posted < TIMEOUT_S:
        replica = engines(gateway)[index]
        if served is None and kind == "scale_out" and replica["url"] and replica["answered"]:
            served = time.monotonic() - posted
        if doc["state"] == "running":
            doc = ADMIN.get(f"{gateway}/genrm/{kind}/{request_id}").json()
        if doc["state"] == "failed":
            raise RuntimeError(f"{kind} failed: {json.dumps(doc)}")
        if doc["state"] != "running" and (served is not None or kind == "scale_in"):
            return doc, served
        time.sleep(POLL_S)
    raise TimeoutError(f"{kind} {request_id}: not done within {TIMEOUT_S:.0f} s: {doc}")


def scale_cycles(gateway: str, repeats: int) -> list[dict[str, float]]:
    """``repeats`` times a scale-out to 2 then a scale-in to 1; each scale-out's figures."""
    new = next(i for i, r in engines(gateway).items() if r["reserved"])
    figures = []
    for repeat in range(repeats):
        posted, request_id = operate(gateway, "scale_out", 2)
        doc, served = follow(gateway, "scale_out", posted, request_id, new)
        start_s = doc["replicas"][0]["seconds"]
        figures.append({"served_s": served, "operation_s": doc["seconds"], "start_s": start_s})
        shown = ", ".join(f"{k} {v:.2f}" for k, v in figures[-1].items())
        print(f"scale-out {repeat + 1}: {shown}", flush=True)
        posted, request_id = operate(gateway, "scale_in", 1)
        doc, _ = follow(gateway, "scale_in", posted, request_id, new)
        print(f"scale-in {repeat + 1}: {doc['seconds']:.2f} s", flush=True)
    return figures


def bare_starts(model: str, logs: Path, repeats: int) -> list[float]:
    """Seconds from launching one SGLang server of the genrm engine to its first token, each."""
    job, path, seconds = load_config(CONFIG, [f"genrm.model={model}"]), ensure_model(model), []
    engine, device = {**job.genrm.engine, "dtype": job.engine_dtype("genrm")}, job.cluster.device
    for repeat in range(repeats):
        log = logs / f"bare-engine-{repeat}.log"
        server = SGLangServer(model_path=path, device=device, log_path=log, engine=engine)
        began = time.monotonic()
        try:
            server.start(timeout_s=job.cluster.startup_timeout_s)
            seconds.append(time.monotonic() - began)
        finally:
            server.stop()
        print(f"bare start {repeat + 1}: {seconds[-1]:.2f} s", flush=True)
    return seconds


def launch(overrides: list[str], console: Path) -> subprocess.Popen:
    cli = Path(sys.executable).with_name("relax-launch")
    command = [str(cli), "run", str(CONFIG), *overrides]
    print(f"job: {' '.join(command)} (log: {console})", flush=True)
    with console.open("w") as out:
        env = {**os.environ, "RELAX_ADMIN_TOKEN": TOKEN}
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )  # fmt: skip


def stop(job: subprocess.Popen) -> int:
    """SIGTERM to the job, then its process group's end (SIGKILL after 120 s); its exit code."""
    job.send_signal(signal.SIGTERM)  # nothing if it has exited
    with contextlib.suppress(subprocess.TimeoutExpired):
        job.wait(timeout=120)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)  # whatever of its group is left
    return job.wait()


def report(scale: list[dict[str, float]], bare: list[float], cpu: dict[str, dict]) -> None:
    """Print the table and the CPU use."""
    rows = {
        "scale-out -> first served (s)": [f["served_s"] for f in scale],
        "scale-out operation (s)": [f["operation_s"] for f in scale],
        "  its replica's start (s)": [f["start_s"] for f in scale],
        "bare engine start (s)": bare,
    }
    medians = {title: statistics.median(values) for title, values in rows.items()}
    print(f"\n{'':<31}{'median':>8}   each")
    for title, values in rows.items():
        print(f"{title:<31}{medians[title]:>8.2f}   " + "  ".join(f"{v:.2f}" for v in values))
    base = medians["bare engine start (s)"]
    ratios = {
        "first served ÷ bare": medians["scale-out -> first served (s)"] / base,
        "operation ÷ bare": medians["scale-out operation (s)"] / base,
    }
    for title, ratio in ratios.items():
        print(f"{title:<31}{ratio:>8.2f}")
    print(f"\ncores: {len(os.sched_getaffinity(0))} (of {psutil.cpu_count()} on the machine)")
    for phase, cores in cpu.items():
        print(f"busy cores during {phase}: " + ", ".join(f"{k} {v:.2f}" for k, v in cores.items()))


def measure(args: argparse.Namespace, run_dir: Path) -> tuple[list, list, dict]:
    """Start the job, scale it out and in, start bare engines; stop the job."""
    models = [f"trainer.model={args.model}", f"genrm.model={args.model}"]
    overrides = ["genrm.autoscale=null", *models, f"logging.dir={run_dir}"]
    job = launch(overrides, run_dir.parent / "console.log")
    stream = cpu = None
    try:
        gateway = gateway_of(run_dir, job)
        print(f"job ready: gateway {gateway}; {args.workers} judge workers start", flush=True)
        cpu, stream = Cpu(job.pid), Stream(gateway, args.workers)
        scale = scale_cycles(gateway, args.repeats)
        phases = {"scale-outs and -ins": cpu.mark()}
        print("bare starts, with the job and the judge stream still running", flush=True)
        bare = bare_starts(args.model, run_dir.parent, args.repeats)
        phases["bare starts"] = cpu.mark()
    finally:
        if stream is not None:
            stream.stop()
            head = f"judge stream: {stream.answered} answered, {len(stream.failures)} failed"
            print(head, *stream.failures[:3], sep="\n  failure: ")
        if cpu is not None:
            cpu._stop.set()
        code = stop(job)
        print(f"job exit code {code}:", "stopped cleanly" if code == EXIT_STOPPED else "NOT clean")
    return scale, bare, phases


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="scale-outs and bare starts (2)")
    parser.add_argument("--workers", type=int, default=2, help="concurrent judge requests (2)")
    parser.add_argument("--model", default="builtin:tiny-llama", help="trainer and genrm model")
    parser.add_argument("--logs", type=Path, help="keep the logs here (default: temporary)")
    args = parser.parse_args(argv)
    begun = time.time()
    work = args.logs or Path(tempfile.mkdtemp(prefix="bench-elastic-"))
    work.mkdir(parents=True, exist_ok=True)
    scale, bare, cpu = measure(args, work / "run")  # on a failure its logs stay in WORK
    if args.logs is None:
        shutil.rmtree(work)
    report(scale, bare, cpu)
    print(f"\n{args.model}; the whole bench took {time.time() - begun:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
