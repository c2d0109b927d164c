"""Rank 0 posting the critic's mini-batch steps (``CriticClient.start_training``): every step's
shard of a DP rank travels in one transfer, so rank 0 has as many sends in flight as for one
step whatever ``critic.mini_batches`` (each holding its DP rank's every mini-batch joined), and
each rank trains the same shards, in the same order, as one post per step gave it; a joined
shard that does not split into equal steps is refused, and a failed step still waits for the
sends."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from relax_launch.runtime.control import Posted
from relax_launch.runtime.critic_worker import CriticClient, joined_shards, split_steps
from relax_launch.trainer.batch import TokenBatch


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
    client.shards = SimpleNamespace(start=lambda shards: transfers.append(shards) or shards)
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
def test_a_failed_critic_step_still_waits_for_its_sends(finish_fails: bool) -> None:
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
    with pytest.raises(Failed, match="rank 2"):  # the step's error, not the send's
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
