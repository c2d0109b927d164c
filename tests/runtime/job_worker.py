"""torchrun worker for the runtime tests: train one step, sync, and report what the engines serve.

usage: torchrun --nproc-per-node N job_worker.py PROGRAM CONFIG OUT.json [key=value ...]
PROGRAM ``sync``: rank 0 writes a JSON report: weight versions, trainer-vs-engine logprob
differences before and after the sync, and a weight compared by name. ``midsync``: a sync
during which one engine dies (the test's fault plugin); the gateway is asked for generations
all along, and the report says what it answered while the sync ran, and the survivor's parity.
``hold``: start, write the engine URLs, then wait to be killed. ``stuck``: send a train step to
trainer rank 1 alone, so it waits for its shard in a broadcast rank 0 never joins. ``rollback``:
a send fails midway (rank 0 sends one tensor with a wrong shape); report what the engines serve
once the sync has sent the version again.
"""

import json
import os
import sys
import time

import torch

from relax_launch.config import load_config
from relax_launch.inference.engine import get_json, post
from relax_launch.placement import plan
from relax_launch.runtime.engine_restart import engine_alive
from relax_launch.runtime.job import run_rank
from relax_launch.runtime.rank_commands import TrainStep
from relax_launch.trainer.batch import TokenBatch
from relax_launch.weights.update_session import WeightSyncError

SEQUENCES = [[5, 17, 42, 99, 7, 150, 23, 61], [9, 88, 31, 4, 270, 12, 55, 200, 13, 77]]
WEIGHT = "model.layers.1.mlp.down_proj.weight"


def engine_logprobs(url: str, tokens: list[int]) -> list[float]:
    reply = post(
        url,
        "/generate",
        {
            "input_ids": tokens,
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        },
        60,
    )
    return [lp for lp, _, _ in reply["meta_info"]["input_token_logprobs"][1:]]


def max_diff(session, urls):
    batch = TokenBatch.next_token(SEQUENCES, [1, 1])
    trainer = session.logprobs(batch)
    return max(
        float((torch.tensor(engine_logprobs(u, t)) - torch.tensor(row)).abs().max())
        for u in urls
        for t, row in zip(SEQUENCES, trainer, strict=True)
    )


def engine_weight(url: str) -> list[float]:
    return post(url, "/get_weights_by_name", {"name": WEIGHT, "truncate_size": 2}, 60)


def gateway_state(session) -> dict:
    """What the job's gateway answers: a real generation's status and the rollout discovery."""
    import httpx

    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    reply = httpx.post(session.gateway_url + "/rollout/generate", json=body, timeout=60)
    engines = httpx.get(session.gateway_url + "/rollout/engines", timeout=30).json()
    model = next(iter(engines["models"].values()))
    return {
        "generate": reply.status_code,
        "retry_after": reply.headers.get("retry-after"),
        "state": model["state"],
        "weight_version": model["weight_version"],
        "alive": httpx.get(session.gateway_url + "/health", timeout=30).json()["alive"],
    }


def program(session):
    urls = session.wait_for_engines()["rollout"]
    session.connect_weight_sync()
    report = {"gateway_before_sync": gateway_state(session)}
    first = session.sync_weights(0)
    report.update(parity_before=max_diff(session, urls), sync0=first)
    report["gateway_after_sync"] = gateway_state(session)
    # Logprobs tell the weights apart: SGLang's Qwen models have no get_weights_by_name.
    before = engine_logprobs(urls[0], SEQUENCES[0])
    batch = TokenBatch.next_token(SEQUENCES, [1, 1])
    report["train"] = [session.train_step(batch) for _ in range(2)]
    report["sync1"] = session.sync_weights(1)
    report["versions"] = [get_json(u, "/model_info", 30)["weight_version"] for u in urls]
    after = [engine_logprobs(u, SEQUENCES[0]) for u in urls]
    report["weight_changed"] = max(abs(a - b) for a, b in zip(after[0], before, strict=True)) > 1e-3
    report["engines_agree"] = all(a == after[0] for a in after)
    report["parity_after"] = max_diff(session, urls)
    report["urls"] = urls
    report["gateway_after_sync1"] = gateway_state(session)
    return report


class Prober:
    """Asks the gateway for a generation every 20 ms on a thread, recording (sent, status)."""

    def __init__(self, url: str) -> None:
        import threading

        self.url, self.log, self.stopped = url, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import httpx

        body = {"text": "Hello", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        with httpx.Client(timeout=60) as client:
            while not self.stopped.is_set():
                sent = time.monotonic()
                status = client.post(self.url + "/rollout/generate", json=body).status_code
                self.log.append((sent, status))
                time.sleep(0.02)

    def stop(self) -> list[tuple[float, int]]:
        self.stopped.set()
        self.thread.join()
        return self.log


def midsync(session):
    session.wait_for_engines()
    session.connect_weight_sync()
    session.sync_weights(0)
    session.train_step(TokenBatch.next_token(SEQUENCES, [1, 1]))
    prober = Prober(session.gateway_url)
    time.sleep(0.5)
    began = time.monotonic()
    report = {"error": None}
    try:
        report["sync"] = session.sync_weights(1)  # one engine dies in it
    except Exception as exc:  # noqa: BLE001 - reported
        report["error"] = str(exc)
    ended = time.monotonic()
    time.sleep(0.5)
    log = prober.stop()
    # sent once the sync had closed routing (it does so first thing), answered before it ended
    report["during"] = sorted({status for t, status in log if began + 0.1 <= t <= ended - 0.5})
    report["before"] = sorted({status for t, status in log if t < began})
    report["after"] = sorted({status for t, status in log if t > ended})
    report["sync_s"] = ended - began
    alive = [e.url for e in session.control_plane.managers["rollout"].serving()]
    report["serving"] = len(alive)
    report["versions"] = [get_json(u, "/model_info", 30)["weight_version"] for u in alive]
    report["parity"] = max_diff(session, alive)
    return report


def hold(session):
    urls = session.wait_for_engines()
    with open(sys.argv[3], "w") as out:
        json.dump(urls, out)
    time.sleep(300)


def stuck(session):
    batch = TokenBatch.next_token(SEQUENCES, [1, 1])
    session.channel.call(TrainStep((batch.shape(),)), [1])


def rollback(session):
    urls = session.wait_for_engines()["rollout"]
    session.connect_weight_sync()
    session.sync_weights(0)
    before = [engine_weight(u) for u in urls]
    session.train_step(TokenBatch.next_token(SEQUENCES, [1, 1]))
    report = {"error": None}
    try:
        # the first send of version 1 has one tensor of a wrong shape, after others applied
        report["sync1"] = session.sync_weights(1)
    except WeightSyncError as exc:
        report["error"] = str(exc)
    report["versions"] = [get_json(u, "/model_info", 30)["weight_version"] for u in urls]
    report["weights_changed"] = [engine_weight(u) for u in urls] != before
    report["parity"] = max_diff(session, urls)
    report["gateway"] = gateway_state(session)
    return report


def scaled(session, kind: str, replicas: int, until: str) -> dict:
    """Ask the gateway to scale rollout to ``replicas``; the operation's document once its
    engine's state is ``until`` (or it ended)."""
    import httpx

    auth = {"authorization": f"Bearer {os.environ['RELAX_ADMIN_TOKEN']}"}
    url = f"{session.gateway_url}/rollout/{kind}"
    reply = httpx.post(url, json={"num_replicas": replicas}, headers=auth, timeout=30)
    assert reply.status_code == 202, reply.text
    status = f"{url}/{reply.json()['request_id']}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        doc = httpx.get(status, headers=auth, timeout=30).json()
        if doc["state"] != "running" or doc["replicas"][0]["state"] == until:
            return doc
        time.sleep(0.2)
    raise TimeoutError(f"{kind}: no {until} within 300 s: {doc}")


def scale_rollout(session):
    """rollout.max_engines=2, one planned engine: scale out by the API; the new engine joins
    the next weight sync and is routed once it holds that version. Its logprobs, read straight
    from it before any request was routed to it, against the trainer's at that version; then
    a scale-in, and a sync to the planned engine alone."""
    import httpx

    urls = session.wait_for_engines()["rollout"]
    session.connect_weight_sync()
    session.sync_weights(0)
    manager = session.control_plane.managers["rollout"]
    joining = scaled(session, "scale_out", 2, until="weight_syncing")
    report = {"joining": joining, "serving_while_joining": [e.url for e in manager.serving()]}
    batch = TokenBatch.next_token(SEQUENCES, [1, 1])
    session.train_step(batch)
    session.sync_weights(1)  # takes the new engine in
    done = scaled_status(session, joining)
    new = done["replicas"][0]["url"]
    report["scale_out"] = done
    report["answered_before_check"] = manager.requests.answered("tiny-llama/1")
    report["new_version"] = get_json(new, "/model_info", 30)["weight_version"]
    report["parity_new"] = max_diff(session, [new])
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    report["routed"] = [
        httpx.post(session.gateway_url + "/rollout/generate", json=body, timeout=60).status_code
        for _ in range(4)
    ]
    report["answered_after"] = manager.requests.answered("tiny-llama/1")
    report["scale_in"] = scaled(session, "scale_in", 1, until="stopped")
    session.train_step(batch)
    report["sync2"] = session.sync_weights(2)
    report["versions_after"] = [get_json(u, "/model_info", 30)["weight_version"] for u in urls]
    report["parity_after"] = max_diff(session, urls)
    report["new_alive"] = engine_alive(new)
    return report


def scale_behind_router(session):
    """scale_rollout in route mode router: the new engine enters sglang-router's workers when
    the sync commits on it, serves requests the gateway sends through the router, and leaves
    the router when scaled in (a few steps, no training: tests/inference/test_router_workers.py
    has the order of each change)."""
    import httpx

    session.wait_for_engines()
    session.connect_weight_sync()
    session.sync_weights(0)
    router = session.control_plane.router.url
    joining = scaled(session, "scale_out", 2, until="weight_syncing")
    report = {"joining": joining, "workers_joining": router_workers(router)}
    session.sync_weights(1)  # takes the new engine in
    report["scale_out"] = done = scaled_status(session, joining)
    new = done["replicas"][0]["url"]
    report["new"], report["workers_out"] = new, router_workers(router)
    served = requests_served(new)
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    generate = session.gateway_url + "/rollout/generate"
    report["routed"] = [httpx.post(generate, json=body, timeout=60).status_code for _ in range(6)]
    report["served_by_new"] = requests_served(new) - served
    report["scale_in"] = scaled(session, "scale_in", 1, until="stopped")
    report["workers_in"] = router_workers(router)
    report["routed_after"] = [httpx.post(generate, json=body, timeout=60).status_code]
    report["new_alive"] = engine_alive(new)
    return report


def router_workers(router: str) -> list[str]:
    return sorted(w["url"] for w in get_json(router, "/workers", 30)["workers"])


def requests_served(url: str) -> float:
    """The requests the engine at ``url`` finished, as its own metrics count them."""
    import httpx

    lines = httpx.get(url + "/metrics", timeout=30).text.splitlines()
    return sum(
        float(line.split()[-1]) for line in lines if line.startswith("sglang:num_requests_total")
    )


def scaled_status(session, doc: dict) -> dict:
    import httpx

    auth = {"authorization": f"Bearer {os.environ['RELAX_ADMIN_TOKEN']}"}
    url = f"{session.gateway_url}/rollout/scale_out/{doc['request_id']}"
    deadline = time.monotonic() + 120
    while (doc := httpx.get(url, headers=auth, timeout=30).json())["state"] == "running":
        assert time.monotonic() < deadline, doc
        time.sleep(0.2)
    return doc


def corrupt_version_1_export():
    """On the source rank: during the sync to version 1, send model.norm.weight truncated."""
    from relax_launch.trainer.trainer import Trainer

    export = Trainer.export_hf_weights

    calls = []

    def corrupted(self, fused=False, changed_only=False):
        calls.append(1)  # export 1 feeds version 0, export 2 feeds version 1
        for name, tensor in export(self, fused, changed_only):
            if len(calls) == 2 and name == "model.norm.weight":
                tensor = tensor[: tensor.shape[0] // 2]
            yield name, tensor

    Trainer.export_hf_weights = corrupted


def main():
    job = load_config(sys.argv[2], sys.argv[4:])
    programs = {
        "sync": program,
        "midsync": midsync,
        "hold": hold,
        "stuck": stuck,
        "rollback": rollback,
        "scale_rollout": scale_rollout,
        "scale_behind_router": scale_behind_router,
    }
    if sys.argv[1] == "rollback" and os.environ["RANK"] == "0":
        corrupt_version_1_export()
    result = run_rank(job, plan(job), programs[sys.argv[1]])
    if result is not None:
        with open(sys.argv[3], "w") as out:
            json.dump(result, out)


if __name__ == "__main__":
    main()
