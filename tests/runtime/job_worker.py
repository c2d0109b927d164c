"""torchrun worker for the runtime tests: train one step, sync, and report what the engines serve.

usage: torchrun --nproc-per-node N job_worker.py CONFIG OUT.json [key=value ...]
Rank 0 writes a JSON report: weight versions, trainer-vs-engine logprob differences before and
after the sync, and a weight compared by name.
"""

import json
import sys
import urllib.request

import torch

from relax_launch.config import load_config
from relax_launch.placement import plan
from relax_launch.runtime.job import run_rank
from relax_launch.trainer.batch import TokenBatch
from relax_launch.weights.engine_client import get_json, post

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
        for t, row in zip(SEQUENCES, trainer)
    )


def engine_weight(url: str) -> list[float]:
    return post(url, "/get_weights_by_name", {"name": WEIGHT, "truncate_size": 2}, 60)


def program(session):
    urls = session.wait_for_engines()["rollout"]
    session.connect_weight_sync()
    first = session.sync_weights(0)
    report = {"parity_before": max_diff(session, urls), "sync0": first}
    before = engine_weight(urls[0])
    batch = TokenBatch.next_token(SEQUENCES, [1, 1])
    report["train"] = [session.train_step(batch) for _ in range(2)]
    report["sync1"] = session.sync_weights(1)
    report["versions"] = [get_json(u, "/model_info", 30)["weight_version"] for u in urls]
    report["weight_changed"] = engine_weight(urls[0]) != before
    report["engines_agree"] = all(engine_weight(u) == engine_weight(urls[0]) for u in urls)
    report["parity_after"] = max_diff(session, urls)
    report["urls"] = urls
    return report


def main():
    job = load_config(sys.argv[1], sys.argv[3:])
    result = run_rank(job, plan(job), program)
    if result is not None:
        with open(sys.argv[2], "w") as out:
            json.dump(result, out)


if __name__ == "__main__":
    main()
