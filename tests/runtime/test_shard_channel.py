"""Rank 0's sends over the ``ShardChannel``, against a recording stand-in for torch.distributed
whose works, kept by it as the process group keeps them, hold what they send until waited (as
NCCL's do, the tensor stashed until the op completes): rank 0 keeps at most one other DP rank's
shard alive, none once ``start`` returns (its own step runs after), and a result's receive is
posted after that DP rank's sends. A receiving rank that fails before its receive (its reply
posted, its send never matched) has its error raised at once, not once the send timed out."""

import gc
import threading
import weakref

import pytest
import torch
import torch.distributed as dist

from relax_launch import platform
from relax_launch.placement.plan import TrainerLayout
from relax_launch.runtime import distributed
from relax_launch.runtime.control import ControlChannel, RemoteError, Shutdown
from relax_launch.runtime.distributed import ShardChannel
from relax_launch.runtime.trainer_client import TrainerClient
from relax_launch.trainer.batch import RowImages, TokenBatch

GROUP_TIMEOUT_S = 5.0  # a send never matched fails its wait after this (NCCL's watchdog)


class Work:
    def __init__(self, log: list, op: str, peer: int, tensor: torch.Tensor, matched) -> None:
        self.log, self.op, self.peer, self.tensor, self.done = log, op, peer, tensor, False
        self.matched = matched  # set once the peer takes it

    def is_completed(self) -> bool:
        return self.matched.is_set()

    def wait(self) -> bool:
        if not self.matched.wait(GROUP_TIMEOUT_S):
            raise RuntimeError(f"the group's timeout: the {self.op} to rank {self.peer} hung")
        self.done, self.tensor = True, None  # completed: the op lets go of its buffer
        self.log.append(("wait", self.op, self.peer))
        return True


class RecordingDist:
    """isend/irecv that log each op and how many sent buffers are alive when it is posted.
    Every work is kept, as the process group keeps it: only its ``wait`` lets the tensor go.
    Ranks in ``unmatched`` never receive (until ``release``)."""

    def __init__(self) -> None:
        self.log: list = []
        self.sent: list[weakref.ref] = []
        self.works: list[Work] = []
        self.unmatched: set[int] = set()
        self.hung = threading.Event()

    def alive(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.sent)

    def isend(self, tensor: torch.Tensor, dst: int) -> Work:
        self.log.append(("isend", dst, self.alive()))
        self.sent.append(weakref.ref(tensor))
        return self._work("send", dst, tensor)

    def irecv(self, tensor: torch.Tensor, src: int) -> Work:
        self.log.append(("irecv", src))
        return self._work("recv", src, tensor)

    def _work(self, op: str, peer: int, tensor: torch.Tensor) -> Work:
        matched = self.hung if peer in self.unmatched else threading.Event()
        if peer not in self.unmatched:
            matched.set()
        self.works.append(Work(self.log, op, peer, tensor, matched))
        return self.works[-1]

    def release(self) -> None:
        self.hung.set()


def never_failed(rank: int) -> None:
    pass


def batch(sequences: int, patches: int = 0) -> TokenBatch:
    tokens = [[1 + i, 2, 3, 4] for i in range(sequences)]
    plain = TokenBatch.next_token(tokens, [1] * sequences)
    if not patches:
        return plain
    grid = torch.tensor([[1, 2, patches // 2]])
    images = tuple(RowImages(torch.rand(patches, 6), grid) for _ in range(sequences))
    return TokenBatch(plain.tokens, plain.loss_mask, plain.token_weights, images=images)


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch):
    fake = RecordingDist()
    monkeypatch.setattr(distributed, "dist", fake)
    yield fake
    fake.release()  # a wait given up on ends


@pytest.mark.parametrize("results", [False, True])
def test_rank0_holds_one_other_shard_at_a_time_and_none_after_start(recording, results):
    layout = TrainerLayout(tuple(range(4)), 1, 1, 4, "train")
    channel = ShardChannel(layout, 0, "cpu", None)
    shards = batch(8, patches=4).shards(4)
    transfer = channel.start(shards, results, failed=never_failed, timeout_s=60)
    sends = [entry for entry in recording.log if entry[0] == "isend"]
    assert len(sends) == 3 * 3  # ids, values, pixels to each other DP rank
    # a DP rank's sends start with none of another DP rank's buffers alive
    assert [alive for _, dst, alive in sends if dst != sends[0][1]][::3] == [0, 0]
    assert recording.alive() == 0  # rank 0's own step starts with no other shard on its device
    assert "shard" in channel.held  # its own, moved to the device by its receive
    if results:  # each result's receive after its DP rank's sends, still posted at the end
        for dp in (1, 2, 3):
            waits = [i for i, e in enumerate(recording.log) if e == ("wait", "send", dp)]
            assert recording.log.index(("irecv", dp)) > max(waits)
        assert len(transfer.works) == 3 and not any(work.done for work in transfer.works)
        channel.held["result"] = torch.zeros(6)  # its own DP rank's, from its step
        assert len(channel.finish(transfer)) == 4


def test_images_travel_in_the_pixel_dtype(recording):
    layout = TrainerLayout(tuple(range(2)), 1, 1, 2, "train")
    shards = batch(2, patches=4).shards(2)
    channel = ShardChannel(layout, 0, "cpu", None, pixel_dtype=torch.bfloat16)
    channel.start(shards, failed=never_failed, timeout_s=60)
    pixels = channel.held["shard"][2]
    assert pixels.dtype == torch.bfloat16
    expected = shards[0].images[0].pixel_values.to(torch.bfloat16)
    assert torch.equal(pixels, expected)  # the cast the tower would make
    assert shards[0].shape().empty("cpu", torch.bfloat16)[2].dtype == torch.bfloat16


ROLES = {r: f"trainer[tp0 pp0 dp{r}]" for r in range(4)}


def test_a_rank_that_failed_before_its_receive_raises_its_error_at_once(recording):
    """Rank 2 runs out of memory making its receive buffers: it replies with the error and
    never receives. Rank 0 raises that error while the send waits, instead of waiting out the
    group's timeout (then losing the error) with ranks 3's shard never sent."""
    store = dist.HashStore()
    rank0 = ControlChannel(store, rank=0, roles=ROLES, timeout_s=60)
    rank2 = ControlChannel(store, rank=2, roles=ROLES, timeout_s=60)

    def out_of_memory(command):
        raise RuntimeError("CUDA out of memory making the shard's buffers")

    serving = threading.Thread(target=rank2.serve, args=({"trainer.logprobs": out_of_memory},))
    serving.start()
    recording.unmatched.add(2)
    layout = TrainerLayout(tuple(range(4)), 1, 1, 4, "train")
    client = TrainerClient(rank0, ShardChannel(layout, 0, "cpu", None), layout, {})
    try:
        with pytest.raises(
            RemoteError, match=r"rank 2 \(trainer\[tp0 pp0 dp2\]\): RuntimeError: CUDA out of"
        ):
            client.logprobs(batch(8))
        assert not any(dst == 3 for op, dst, *_ in recording.log if op == "isend")
    finally:
        rank0.post(Shutdown(), [2])
        serving.join(10)
        rank0.close()


def test_a_send_never_received_nor_failed_times_out_naming_the_rank(recording):
    recording.unmatched.add(1)
    channel = ShardChannel(TrainerLayout((0, 1), 1, 1, 2, "train"), 0, "cpu", None)
    with pytest.raises(TimeoutError, match="rank 1 did not receive its shard within 0 s"):
        channel.start(batch(4).shards(2), failed=never_failed, timeout_s=0.05)


class Gone(RuntimeError):
    pass


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # a thread waits gloo's; NCCL's are polled
def test_wait_sent_ends_with_the_sends_or_the_receivers_error(device):
    ended, hung = threading.Event(), threading.Event()
    ended.set()
    done = Work([], "send", 1, torch.zeros(1), ended)
    assert platform.wait_sent([done], torch.device(device), 5, lambda: None)
    assert done.done  # waited: the buffer is let go
    pending = Work([], "send", 1, torch.zeros(1), hung)
    assert not platform.wait_sent([pending], torch.device(device), 0.05, lambda: None)
    checks = []

    def check():
        checks.append(1)
        if len(checks) == 3:
            raise Gone("rank 1 failed")

    with pytest.raises(Gone):
        platform.wait_sent([pending], torch.device(device), 5, check)
    hung.set()  # the thread given up on ends
