"""Fully asynchronous rollout (``algorithm.max_staleness: k``, decoupled placement): the rollout
engines generate all the time, the trainer takes finished groups as it needs them.

A producer on the job's event loop starts a batch of ``prompts_per_step`` groups whenever it
is at most ``k`` batches ahead of the weights the engines serve, and queues each group when its
``n`` samples are done. When new weights are ready, ``pause`` aborts what is in flight (SGLang
returns each request's tokens so far), the sync runs on idle engines, and ``resume`` lets every
interrupted generation continue from its own tokens with the new weights (a partial rollout).
Each token carries the weight version that produced it; a sample whose oldest token is more
than ``k`` versions old when trained is dropped and counted (``rl.phases.drop_stale``).

A prompt with images (a vision-language policy, ``rl/vision_prompts.py``) is sent as the one-turn
rollout sends it: the template's ids with one placeholder per image, and the images. SGLang's
processor decodes those ids (with the tokens so far of an interrupted generation) to find the
images' placeholders; it keeps the ids sent, each image's placeholder expanded, and re-tokenises
the decoded text only as a fallback, with a warning, where that expansion fails (docs/vlm.md
"Gateway and agentic turns"). A continuation whose ids the engine read otherwise than the first
segment's prompt ids and the tokens so far (the fallback split a sampled reply otherwise) was
generated from other tokens than the trained ones: its tokens are dropped and the sample starts
again from the prompt, as it does when the tokens so far show a media placeholder
(``shows_media``: the random policy samples one; sent back, the engine would read one image
more, or a video, than it gets, and refuse it). Both are counted in ``async/image_restarts``; a
sample started again ``MAX_RESTARTS`` times is given up (invalid, counted in
``async/image_samples_given_up``) rather than failing the job.

With ``rollout.function``, each sample is a conversation (``rl/agent.py``) and each of its turns
is interrupted and continued the same way; a vision-language policy's conversations get their
images (``rl/agent_vision.py``) off the event loop.

Under ``rollout.fault_tolerance`` an engine may die mid-generation. The segment it was
generating (the tokens since the last interruption, which SGLang had not returned) dies with it,
and the controller sends the same segment to another engine (``inference/inprocess.py``,
counted in ``rollout/prompts_regenerated``): the tokens got back at earlier interruptions are
kept, each with its version, as they are valid samples of the weights that made them. A pause
passes over an engine that is gone (``Session.abort_rollout``); the restarted engine takes the
next sync.

On a resume from a checkpoint, the prompts in flight when it was written (at most ``(k + 1)``
batches) are not generated again.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from relax_launch.console import operator_log
from relax_launch.deadline import Deadline
from relax_launch.inference.client import InferenceError
from relax_launch.inference.inprocess import EngineClients
from relax_launch.rl.agent import (
    AgentClient,
    ClientFactory,
    RolloutFunction,
    converse,
    to_sample,
)
from relax_launch.rl.agent_vision import AgentVision
from relax_launch.rl.data import Prompt
from relax_launch.rl.rollout import prompt_inputs, reply_sample, weight_version_of
from relax_launch.rl.samples import Sample
from relax_launch.rl.vision_prompts import shows_media

MAX_SEGMENTS = 64  # continuations of one sample: more means the engines abort on their own
MAX_RESTARTS = 3  # of a sample with images: one started again more often is given up
PAUSE_S = 60.0  # bound on the wait for the aborted generations to come back
POLL_S = 0.05


class ImageRestartsExceeded(RuntimeError):
    """A sample with images was started again ``MAX_RESTARTS`` times: it is given up."""


class ContinuousRollout:
    """The producer of groups (see the module docstring); ``take`` is for the RL loop's thread,
    the rest runs on the engines' event loop."""

    def __init__(
        self,
        engines: EngineClients,
        draw: Callable[[], list[tuple[Prompt, list[int]]]],
        abort: Callable[[], None],
        tokenizer: Any,
        *,
        agent: RolloutFunction | None,
        n: int,
        max_staleness: int,
        sampling: dict[str, Any],
        max_tokens: int,
        version: int,
        client: ClientFactory = AgentClient,
        vision: AgentVision | None = None,
    ) -> None:
        self.engines, self.draw, self.abort, self.tokenizer = engines, draw, abort, tokenizer
        self.agent = agent  # rollout.function: conversations instead of single responses
        self.vision = vision  # gives a vision-language policy's conversations their images
        self.client = client  # records each conversation (rollout.multi_turn)
        self.n, self.k, self.sampling, self.max_tokens = n, max_staleness, sampling, max_tokens
        self.version = version  # the weights the engines serve
        self.batches = 0  # batches started
        self.finished: queue.Queue[list[Sample] | BaseException] = queue.Queue()
        self.in_flight = 0
        self.paused = False
        self.running: asyncio.Event | None = None  # set while generation may go on
        self.wakeup: asyncio.Event | None = None  # the producer re-checks its bound
        self.producer: Any = None
        self.tokens, self.since = 0, time.monotonic()  # generated since ``throughput`` last ran
        # seconds with a request in flight: closed spans, the open one's start (the loop's),
        # and the total ``busy_seconds`` last read (the RL loop's)
        self.busy, self.busy_since, self.busy_read = 0.0, None, 0.0
        # image samples started again, and given up, since the RL loop's thread last read them
        self.counts = threading.Lock()  # incremented on the loop, read and reset on the RL loop's
        self.restarts = self.given_up = 0

    def start(self) -> None:
        self.producer = self.engines.start_soon(self._produce())

    def close(self) -> None:
        if self.producer is not None:
            self.producer.cancel()

    # ---- the RL loop's side --------------------------------------------------------------

    def take(self, groups: int, timeout_s: float) -> list[Sample]:
        """The next ``groups`` finished groups' samples (in the order they finished)."""
        samples: list[Sample] = []
        deadline = Deadline(timeout_s)
        for _ in range(groups):
            try:
                item = self.finished.get(timeout=deadline.left())
            except queue.Empty:
                raise TimeoutError(
                    f"the continuous rollout finished {len(samples) // self.n} of {groups} "
                    f"groups within {timeout_s:.0f} s; check the rollout engines' logs"
                ) from None
            if isinstance(item, BaseException):
                raise RuntimeError(f"the continuous rollout failed: {item}") from item
            samples += item
        for number, sample in enumerate(samples):
            sample.group = number // self.n
        return samples

    def throughput(self) -> float:
        """Tokens per second the engines generated since the last call (the rollout phase of a
        step only waits for finished groups, so its own time says nothing about generation)."""
        now = time.monotonic()
        rate = self.tokens / max(now - self.since, 1e-9)
        self.tokens, self.since = 0, now
        return rate

    def image_restarts(self) -> int:
        """Samples with images started again from their prompt since the last call (the module
        docstring)."""
        with self.counts:
            restarts, self.restarts = self.restarts, 0
        return restarts

    def image_samples_given_up(self) -> int:
        """Samples with images given up after ``MAX_RESTARTS`` restarts since the last call
        (invalid, not trained)."""
        with self.counts:
            given_up, self.given_up = self.given_up, 0
        return given_up

    def busy_seconds(self) -> float:
        """Seconds the engines had a request of this rollout in flight since the last call: the
        engine time the step's samples took, for the rollout autoscaler."""
        since = self.busy_since
        total = self.busy + (time.monotonic() - since if since is not None else 0.0)
        busy, self.busy_read = total - self.busy_read, total
        return max(busy, 0.0)

    def pause(self) -> None:
        """Stop generating: nothing new starts, what runs is aborted and comes back with its
        tokens so far; returns when no request is in flight (the engines are idle)."""
        self._on_loop(self._set_paused, True)
        deadline = Deadline(PAUSE_S)
        while self.in_flight:
            self.abort()  # again: a request sent just before the first abort reached no engine
            if deadline.passed:
                raise TimeoutError(
                    f"{self.in_flight} rollout requests still in flight {PAUSE_S:.0f} s after "
                    "they were aborted for the weight sync"
                )
            time.sleep(POLL_S)

    def resume(self, version: int) -> None:
        """Generate again, with the engines serving ``version``."""
        self.version = version
        self._on_loop(self._set_paused, False)

    def _on_loop(self, function: Callable[[bool], None], value: bool) -> None:
        try:
            self.engines.start_soon(_called(function, value)).result(PAUSE_S)
        except TimeoutError:
            raise TimeoutError(
                f"the continuous rollout's {'pause' if value else 'resume'} did not run within "
                f"{PAUSE_S:.0f} s: the engine clients' event loop is blocked"
            ) from None

    # ---- the event loop's side -----------------------------------------------------------

    def _set_paused(self, paused: bool) -> None:
        self.paused = paused
        if self.running is not None and self.wakeup is not None:
            (self.running.clear if paused else self.running.set)()
            self.wakeup.set()

    async def _produce(self) -> None:
        self.running, self.wakeup = asyncio.Event(), asyncio.Event()
        if not self.paused:
            self.running.set()
        groups: set[asyncio.Task] = set()
        try:
            while True:
                while self.paused or self.batches > self.version + self.k:
                    self.wakeup.clear()
                    await self.wakeup.wait()
                prompts = self.draw()
                self.batches += 1
                for prompt, ids in prompts:
                    task = asyncio.ensure_future(self._group(prompt, ids, f"b{self.batches}"))
                    groups.add(task)
                    task.add_done_callback(groups.discard)
        except Exception as exc:  # noqa: BLE001 - the loop's thread raises it from take()
            self.finished.put(exc)
        finally:
            for task in groups:
                task.cancel()

    async def _group(self, prompt: Prompt, ids: list[int], key: str) -> None:
        one = self._conversation if self.agent is not None else self._sample
        try:
            samples = await asyncio.gather(*(one(prompt, ids, key) for _ in range(self.n)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - an engine's failure fails the next take()
            self.finished.put(exc)
            return
        self.finished.put(list(samples))
        self.wakeup.set()

    async def _sample(self, prompt: Prompt, ids: list[int], key: str) -> Sample:
        """One response to the prompt."""
        sampling = self.sampling | {"max_new_tokens": self.max_tokens}
        body = {**prompt_inputs(prompt, ids), "return_logprob": True, "sampling_params": sampling}
        try:
            reply = await self._generate(body, key)
        except ImageRestartsExceeded as error:
            self._give_up(prompt, error)
            meta = {"output_token_logprobs": [], "weight_version": str(self.version)}
            empty = {"text": "", "output_ids": [], "prompt_token_ids": ids, "meta_info": meta}
            sample = reply_sample(0, prompt, ids, empty)
            sample.valid, sample.token_versions = False, []
            return sample
        sample = reply_sample(0, prompt, ids, reply)
        sample.token_versions = reply["meta_info"]["token_versions"]
        return sample

    async def _conversation(self, prompt: Prompt, ids: list[int], key: str) -> Sample:
        """One conversation of the rollout function (``rl/agent.py``), each of its turns
        resumable as a plain response is."""
        client = self.client(
            functools.partial(self._generate, key=key),
            self.tokenizer,
            self.sampling["temperature"],
            self.max_tokens,
        )
        try:
            images = self.engines.client("rollout").images  # gateway.images
            conversation, outcome = await converse(self.agent, prompt, client, images)
        except ImageRestartsExceeded as error:
            self._give_up(prompt, error)
            conversation, outcome = None, "failed"
        sample = to_sample(0, (prompt, ids), client, conversation, outcome)
        sample.token_versions = client.trajectory.token_versions
        if self.vision is not None:  # the processor's work, off the loop
            await asyncio.get_running_loop().run_in_executor(
                None, self.vision.attach, sample, client.trajectory, prompt.index
            )
        return sample

    async def _generate(self, body: dict[str, Any], key: str) -> dict[str, Any]:
        """``/generate`` continued after every abort from its own tokens, with the weights the
        engines then serve; one reply for all of it, each token's weight version in
        ``meta_info["token_versions"]``."""
        client = self.engines.client("rollout")
        ids, wanted = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        prompt: list[int] | None = None  # with images: the prompt's ids as the engine read them
        out: list[int] = []
        logprobs: list[list[Any]] = []
        versions: list[int] = []
        meta: dict[str, Any] = {}
        finish: dict[str, Any] = {}
        restarts = 0
        for _ in range(MAX_SEGMENTS):
            await self.running.wait()
            if "image_data" in body and shows_media(out, self.tokenizer):  # not a continuation
                out, logprobs, versions = [], [], []
                restarts = self._restarted(restarts)
            sampling = body["sampling_params"] | {"max_new_tokens": wanted - len(out)}
            segment = body | {"input_ids": ids + out, "sampling_params": sampling}
            self._count_in_flight(+1)
            try:
                reply = await client.request("/generate", segment, affinity_key=key)
            except InferenceError as error:
                if error.status == 503 and self.paused:  # refused while the sync runs
                    continue
                raise
            finally:
                self._count_in_flight(-1)
            meta, got = reply["meta_info"], list(reply["output_ids"])
            if "image_data" in body:
                prompt = prompt or reply.get("prompt_token_ids")
                if prompt is not None and reply.get("prompt_token_ids") != prompt + out:
                    out, logprobs, versions, meta = [], [], [], {}  # read otherwise: start again
                    restarts = self._restarted(restarts)
                    continue
            out += got
            self.tokens += len(got)
            logprobs += meta["output_token_logprobs"]
            version = weight_version_of(meta)
            versions += [self.version if version is None else version] * len(got)
            finish = meta.get("finish_reason") or {}
            if finish.get("type") != "abort" or len(out) >= wanted:
                break
        if not meta:
            raise RuntimeError(f"the rollout engines refused a generation {MAX_SEGMENTS} times")
        if finish.get("type") == "abort":  # out of tokens while being interrupted
            finish = {"type": "length", "length": len(out)}
        meta |= {"output_token_logprobs": logprobs, "finish_reason": finish}
        oldest = min(versions, default=self.version)
        meta |= {"token_versions": versions, "weight_version": str(oldest)}
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        reply = {"text": text, "output_ids": out, "meta_info": meta}
        return reply | ({"prompt_token_ids": prompt} if prompt is not None else {})

    def _restarted(self, restarts: int) -> int:
        """Count one more restart of a sample with images (it had ``restarts``); past
        ``MAX_RESTARTS`` the sample is given up instead."""
        if restarts >= MAX_RESTARTS:
            raise ImageRestartsExceeded(
                f"its generation was started again from the prompt {MAX_RESTARTS} times (the "
                "policy kept sampling a media placeholder, or the engine kept reading the "
                "continuation otherwise)"
            )
        with self.counts:
            self.restarts += 1
        return restarts + 1

    def _give_up(self, prompt: Prompt, error: ImageRestartsExceeded) -> None:
        """Count a sample with images given up (``async/image_samples_given_up``)."""
        with self.counts:
            self.given_up += 1
        operator_log().warning(
            f"relax-launch: a sample of prompt {prompt.index} is given up, not trained "
            f"(async/image_samples_given_up): {error}"
        )

    def _count_in_flight(self, change: int) -> None:
        """One request more or fewer in flight, and the busy time that opens or closes."""
        if self.in_flight == 0:
            self.busy_since = time.monotonic()
        self.in_flight += change
        if self.in_flight == 0 and self.busy_since is not None:
            self.busy += time.monotonic() - self.busy_since
            self.busy_since = None


async def _called(function: Callable[[bool], None], value: bool) -> None:
    function(value)  # on the loop: its events are the loop's
