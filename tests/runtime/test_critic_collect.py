"""Rank 0 posting the critic's mini-batch steps (``CriticClient.start_training``): every step's
shard of a DP rank travels in one transfer whatever ``critic.mini_batches`` (one send per DP
rank, holding its every mini-batch joined), and each rank trains the same shards, in the same
order, as one post per step gave it; a joined shard that does not split into equal steps is
refused, and a failed step still ends its transfer (the sends ended in ``start_training``),
then raises the step's error. The critic rank whose reply rank 0 reads brackets each step with
the job's event tickets (the clock-free order ``critic/overlapped_steps`` reads:
tests/rl/test_gae.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from relax_launch.runtime.control import Posted
from relax_launch.runtime.critic_worker import (
    ORDER_KEY,
    CriticClient,
    CriticTrainSteps,
    CriticWorker,
    joined_shards,
    split_steps,
)
from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.critic import STEP_TICKETS


def batch_of(rows: int, first: int = 10) -> TokenBatch:
    tokens = [[first + i, first + i + 1, first + i + 2 + (i % 3)] for i in range(rows)]
    return TokenBatch.next_token(tokens, [1] * rows)


def client_recording(dp_size: int) -> tuple[CriticClient, list, list]:
    posts, transfers = [], []
    client = object.__new__(CriticClient)
    client.layout = SimpleNamespace(dp_size=dp_size, ranks=(2, 3))

    def post(command, ranks):
        posts.append(command)
        return Posted(len(posts), command, tuple(ranks))

    client.channel = SimpleNamespace(post=post, timeout_s=600.0)

    def start(shards, results=False, *, failed, timeout_s):
        transfers.append(shards)
        return shards

    client.shards = SimpleNamespace(start=start)
    return client, posts, transfers


@pytest.mark.parametrize("steps", [1, 4])
def test_every_mini_batch_of_a_dp_rank_travels_in_one_transfer(steps: int) -> None:
    batch = batch_of(8 * steps)
    size = len(batch) // steps
    mini = [batch.select(range(k * size, (k + 1) * size)) for k in range(steps)]
    client, posts, transfers = client_recording(dp_size=2)
    client.start_training(mini, value_clip=0.2)
    (command,) = posts  # one post, one transfer of one shard per DP rank
    (joined,) = transfers
    assert len(joined) == 2 and command.steps == steps and command.value_clip == 0.2
    assert command.shapes == tuple(s.shape() for s in joined)
    for dp in range(2):  # what rank dp trains, step by step: what a post per step sent it
        assert split_steps(joined[dp], steps) == [m.shards(2)[dp] for m in mini]


def test_the_joined_shards_keep_every_field_in_order() -> None:
    first, second = batch_of(4), batch_of(4, first=40)
    first = TokenBatch(
        first.tokens, first.loss_mask, first.token_weights, old_logprobs=first.token_weights
    )
    second = TokenBatch(
        second.tokens, second.loss_mask, second.token_weights, old_logprobs=second.loss_mask
    )
    joined = joined_shards([first, second], 1)[0]
    assert joined.tokens == first.tokens + second.tokens
    assert joined.old_logprobs == first.token_weights + second.loss_mask
    assert split_steps(joined, 2) == [first, second]


def test_a_joined_shard_that_does_not_split_evenly_is_refused_naming_the_sizes() -> None:
    with pytest.raises(ValueError, match="of 7 rows does not split into 2 equal steps"):
        split_steps(batch_of(7), 2)


class Failed(RuntimeError):
    pass


@pytest.mark.parametrize("finish_fails", [False, True])
def test_a_failed_critic_step_still_ends_its_transfer(finish_fails: bool) -> None:
    client, _, _ = client_recording(dp_size=2)
    client.local, finished = {}, []

    def collect(posted, local, timeout_s):
        raise Failed("critic.train_steps failed on rank 2")

    def finish(transfer):
        finished.append(transfer)
        if finish_fails:
            raise RuntimeError("send aborted")

    client.channel.collect = collect
    client.shards.finish = finish
    started = client.start_training([batch_of(4)], value_clip=None)
    with pytest.raises(Failed, match="rank 2"):  # the step's error, not the transfer's
        client.finish_training(started)
    assert finished == [started[1]]


def test_the_critics_steps_are_waited_for_one_steps_bound_each() -> None:
    """One command runs ``critic.mini_batches`` optimizer steps: the collect's bound is one
    step's (the control channel's) times the steps, not one step's for all of them."""
    client, _, _ = client_recording(dp_size=1)
    client.local, bounds = {}, []

    def collect(posted, local, timeout_s):
        bounds.append(timeout_s)
        return {2: [{"critic/value_loss": 0.1}] * posted.command.steps}

    client.channel.collect = collect
    client.shards.finish = lambda transfer: None
    client._last_stage_rank = lambda: 2
    client.finish_training(client.start_training([batch_of(4)] * 3, value_clip=None))
    assert bounds == [1800.0]


class CountingStore:
    """The store's atomic add (the job's event counter), the critic's steps recorded beside."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, key: str, amount: int) -> int:
        self.counts[key] = self.counts.get(key, 0) + amount
        return self.counts[key]


def worker_on(rank: int, reporting: int, store: CountingStore | None):
    """A critic rank whose steps record the counter's value while they run."""
    ran = []

    def train_step(shard, clip):
        ran.append(store.counts.get(ORDER_KEY) if store else None)
        return {"critic/value_loss": 0.1, "critic/clip_fraction": 0.0, "critic/grad_norm": 1.0}

    worker = CriticWorker.__new__(CriticWorker)
    worker.critic = SimpleNamespace(step=0, train_step=train_step)
    worker.offloader = SimpleNamespace(require=lambda op, parts: None)
    worker.order = store
    worker.shards = SimpleNamespace(
        rank=rank, dp_rank=0, result_rank=lambda dp: reporting, receive=lambda s: batch_of(4)
    )
    return worker, ran


def test_the_reporting_critic_rank_brackets_each_step_with_the_jobs_tickets() -> None:
    store = CountingStore()
    worker, ran = worker_on(rank=2, reporting=2, store=store)
    replies = worker.train_steps(CriticTrainSteps((batch_of(4).shape(),), 2, None))
    # each step ran between its two tickets: taken just before it and just after
    assert [tuple(r[k] for k in STEP_TICKETS) for r in replies] == [(1, 2), (3, 4)]
    assert ran == [1, 3]


@pytest.mark.parametrize("reporting, order", [(3, True), (2, False)])
def test_no_tickets_from_a_rank_rank0_does_not_read_or_without_the_store(reporting, order):
    store = CountingStore()
    worker, _ = worker_on(rank=2, reporting=reporting, store=store if order else None)
    replies = worker.train_steps(CriticTrainSteps((batch_of(4).shape(),), 2, None))
    assert not any(set(STEP_TICKETS) & set(r) for r in replies) and store.counts == {}
