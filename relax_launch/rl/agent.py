"""Agentic rollouts: a user function (``rollout.function``) holds a conversation of several
turns, tools included, through an OpenAI-compatible client; the engine's tokens are trained
with the engine's own ids and logprobs, and everything between them (tool results, user turns,
the chat template's markup) is in the sequence but masked out of the loss.

Token in, token out (``rollout.multi_turn: continue_tokens``): each turn is generated from the
exact token ids of the conversation so far (the earlier turns' engine ids, then the template's
rendering of the messages added since), so nothing the engine produced is ever re-tokenised,
also where the template renders earlier turns otherwise once more come (Qwen3 drops their
``<think>`` blocks): the sample is what the engine saw. A call whose conversation does not extend
the previous turn (an edited assistant reply, a new history) cannot be trained exactly: the
sample is rejected and counted (``agent/rejected``); so is a template that rewrites earlier turns
under ``strict``. ``per_turn`` (``rl/agent_turns.py``) makes each turn a sample of its own, with
the context the template renders at inference.

A rollout function: ``async def fn(prompt, client) -> list[dict]`` gets the prompt (its
``messages``, ``label``, ``data_source``) and the client, and returns the conversation; the
sample's text (what rewards read) is its last assistant message.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from relax_launch.rl.agent_images import ConversationImages, as_the_engine_saw, image_request
from relax_launch.rl.agent_vision import AgentVision, attach_images
from relax_launch.rl.calculator import calculator
from relax_launch.rl.data import Prompt
from relax_launch.rl.rollout import all_or_none, weight_version_of
from relax_launch.rl.samples import Sample, TurnTokens
from relax_launch.rl.vision_prompts import shows_media, text_of

if TYPE_CHECKING:  # rank 0's engine clients; the CLI's input check imports this module
    from relax_launch.inference.images import ImagePolicy
    from relax_launch.inference.inprocess import EngineClients

SENTINEL = "\u2063relax-sentinel\u2063"  # a reply text no template alters: what follows it
TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)  # Hermes / Qwen
ACCEPTED = {"model", "tool_choice", "n", "stream", "temperature", "top_p", "stop", "tools"}
ACCEPTED |= {"max_tokens", "max_completion_tokens"}
Engine = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]  # a /generate body -> its reply


class RolloutBudgetExceeded(RuntimeError):
    """The conversation has used data.max_response_tokens; the rollout function may let it
    propagate: the sample ends there and is trained as it is."""


class RejectedTrajectory(RuntimeError):
    """The conversation cannot go on as recorded: a turn with images after a reply that
    shows a media placeholder (``rl/agent_images.py``); the sample is rejected."""


@dataclass
class Trajectory:
    """The tokens of one conversation after its prompt: ``mask`` 1 where the engine produced
    the token (with its ``logprobs``), 0 where the conversation did."""

    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    mask: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    versions: list[int] = field(default_factory=list)  # of each turn (its oldest token's)
    token_versions: list[int] = field(default_factory=list)  # of each token, where replies say
    finish_reason: str = ""
    rejected: str | None = None
    images: list[str] = field(default_factory=list)  # the conversation's, in prompt order


def as_dict(message: Any) -> dict[str, Any]:
    """A message as the chat template reads it (``openai`` message objects too)."""
    if hasattr(message, "model_dump"):
        return message.model_dump(exclude_none=True)
    return dict(message)


def for_template(message: dict[str, Any]) -> dict[str, Any]:
    """The message as an OpenAI-compatible server hands it to the chat template: tool calls'
    JSON ``arguments`` as objects (SGLang's serving_chat does so; templates such as Qwen2.5's
    would otherwise encode the string once more)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for call in calls:
        function = dict(call.get("function") or {})
        try:
            arguments = json.loads(function.get("arguments", ""))
        except (TypeError, ValueError):
            arguments = None
        if isinstance(arguments, dict):
            function["arguments"] = arguments
        parsed.append({**call, "function": function})
    return {**message, "tool_calls": parsed}


class AgentClient:
    """What a rollout function gets: ``client.chat.completions.create(messages=..., tools=...,
    temperature=..., max_tokens=...)`` as in the ``openai`` package, answered by the job's
    rollout engines (``n`` must be 1; ``model`` is ignored) and recorded in ``trajectory``."""

    def __init__(
        self, engine: Engine, tokenizer: Any, temperature: float, budget: int, strict: bool = False
    ) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.strict = strict  # reject a template that rewrites earlier turns (multi_turn: strict)
        self.temperature, self.budget = temperature, budget
        self.trajectory = Trajectory()
        self.history: list[dict[str, Any]] | None = None  # the messages of the last call
        self.reply: dict[str, Any] = {}  # the assistant message it returned
        self.ended_with: int | None = None  # its stop token, when the engine produced one
        self.engine_error: Exception | None = None  # raised by the engines: fails the step
        self.scores: dict[str, float] = {}  # rewards the rollout computed (an environment's)
        self.images = ConversationImages()  # the prompt's own and gateway.images (converse)
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def render(self, messages: list[dict[str, Any]], tools: Any, generate: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [for_template(m) for m in messages],
            tools=tools,
            add_generation_prompt=generate,
            tokenize=False,
        )

    async def create(self, *, messages: list[Any], **options: Any) -> Any:
        unknown = set(options) - ACCEPTED
        if unknown or options.get("n", 1) != 1 or options.get("stream"):
            raise TypeError(
                f"the agent client does not take {sorted(unknown) or 'n != 1 or stream'}; it "
                f"takes messages and {', '.join(sorted(ACCEPTED - {'n', 'stream'}))}"
            )
        conversation = [as_dict(m) for m in messages]
        # before anything is recorded: user code's images refused (ImageRefused) fail this
        # sample, not the step, unless the rollout function catches it and goes on
        images = await self.images.sent(conversation)
        context, left = self._context(conversation, options.get("tools"))
        if left <= 0:
            raise RolloutBudgetExceeded(f"the conversation used its {self.budget} tokens")
        wanted = options.get("max_completion_tokens") or options.get("max_tokens") or left
        sampling = {
            "temperature": options.get("temperature", self.temperature),
            "max_new_tokens": min(wanted, left),
        }
        sampling |= {k: options[k] for k in ("top_p", "stop") if options.get(k) is not None}
        body = {"input_ids": context, "return_logprob": True}
        body |= image_request(context, images, self.tokenizer)
        if "image_data" in body and self._sampled_media():
            self.trajectory.rejected = "a reply the policy sampled shows a media placeholder"
            raise RejectedTrajectory(self.trajectory.rejected)  # the engine would refuse it
        try:
            reply = await self.engine(body | {"sampling_params": sampling})
        except Exception as exc:  # the engines' failure, not the rollout function's
            self.engine_error = exc
            raise
        if "image_data" in body:
            self.trajectory.images = body["image_data"]
            why = as_the_engine_saw(self.trajectory, reply["prompt_token_ids"], self.tokenizer)
            self.trajectory.rejected = self.trajectory.rejected or why
        text = self._record(reply)
        self.history = conversation
        return self._completion(text, reply)

    def _sampled_media(self) -> bool:
        """Whether the tokens the engine sampled so far show a media placeholder: sent with
        images, the engine would count it as one more (``vision_prompts.shows_media``)."""
        t = self.trajectory
        return shows_media([i for i, m in zip(t.ids, t.mask, strict=True) if m], self.tokenizer)

    def _context(self, conversation: list[dict[str, Any]], tools: Any) -> tuple[list[int], int]:
        """(the ids this turn is generated from, the tokens the budget has left for it)."""
        new_tokens = self._extend(conversation, tools)
        t = self.trajectory
        t.ids += new_tokens
        t.mask += [0.0] * len(new_tokens)
        t.logprobs += [0.0] * len(new_tokens)
        return t.prompt_ids + t.ids, self.budget - len(t.ids)

    def recorded_turns(self) -> list[Trajectory]:
        """The trajectories that become training rows: here the one conversation."""
        return [self.trajectory]

    def _extend(self, conversation: list[dict[str, Any]], tools: Any) -> list[int]:
        """The token ids to add before this turn: the whole prompt on the first call; after
        that, the end of the previous reply and the messages added since. A conversation that
        does not extend the last one rejects the trajectory; it is then rendered afresh at each
        call, so that the rollout function carries on."""
        t, encode = self.trajectory, self.tokenizer.encode
        if self.history is not None and t.rejected is None:
            why, added = self._added(conversation, tools)
            if why is None:
                return encode(added, add_special_tokens=False)
            t.rejected = why
        t.prompt_ids = encode(self.render(conversation, tools, True), add_special_tokens=False)
        t.ids, t.mask, t.logprobs = [], [], []
        return []

    def _added(self, conversation: list[dict[str, Any]], tools: Any) -> tuple[str | None, str]:
        """(why the conversation does not extend the last one, or None; the text it adds: the
        template's end of the last reply, less the stop token the engine produced, then the new
        messages and the generation prompt, all as the template renders them after a reply of
        its own, whatever it makes of the earlier turns)."""
        seen = len(self.history)
        if conversation[:seen] != self.history or conversation[seen : seen + 1] != [self.reply]:
            return "the conversation is not the previous one plus the reply it got", ""
        if self.strict:
            before = self.render(conversation[: seen + 1], tools, generate=False)
            if not self.render(conversation, tools, generate=True).startswith(before):
                return "the chat template rewrites earlier turns", ""
        marked = [*self.history, {"role": "assistant", "content": SENTINEL}]
        marked += conversation[seen + 1 :]
        end = self.render(marked, tools, generate=True).split(SENTINEL, 1)[1]
        if self.ended_with is not None:
            end = end.removeprefix(self.tokenizer.decode([self.ended_with]))
        return None, end

    def _record(self, reply: dict[str, Any]) -> str:
        t, meta = self.trajectory, reply["meta_info"]
        out = list(reply["output_ids"])
        logprobs = [float(lp) for lp, *_ in meta["output_token_logprobs"]]
        if len(logprobs) != len(out):
            raise RuntimeError(
                f"the engine returned {len(logprobs)} logprobs for {len(out)} tokens"
            )
        t.ids += out
        t.mask += [1.0] * len(out)
        t.logprobs += logprobs
        t.turns += 1
        version = weight_version_of(meta)
        if version is not None:
            t.versions.append(version)
        turn = meta.get("token_versions") or [version or 0] * len(out)
        t.token_versions += [turn[0] if turn else 0] * (
            len(t.ids) - len(out) - len(t.token_versions)
        )
        t.token_versions += turn
        finish = meta.get("finish_reason") or {}
        t.finish_reason = finish.get("type", "")
        matched = finish.get("matched")
        self.ended_with = matched if isinstance(matched, int) and out[-1:] == [matched] else None
        return reply["text"]

    def _completion(self, text: str, reply: dict[str, Any]) -> Any:
        """The reply as openai's ChatCompletion; tool calls parsed from ``<tool_call>`` JSON."""
        from openai.types.chat import ChatCompletion  # rank 0, agentic jobs only

        calls = []
        for number, match in enumerate(TOOL_CALL.finditer(text)):
            try:
                call = json.loads(match.group(1))
                arguments = call.get("arguments", {})
                function = {"name": str(call["name"]), "arguments": json.dumps(arguments)}
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # not a well-formed call: it stays in the text
            calls.append({"id": f"call_{number}", "type": "function", "function": function})
        content = TOOL_CALL.sub("", text).strip() if calls else text
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        self.reply = message
        ended = "length" if self.trajectory.finish_reason == "length" else "stop"
        finish = "tool_calls" if calls else ended
        meta = reply["meta_info"]
        return ChatCompletion.model_validate(
            {
                "id": str(meta.get("id", "relax")),
                "object": "chat.completion",
                "created": int(time.time()),
                "model": "rollout",
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {
                    "prompt_tokens": meta.get("prompt_tokens", 0),
                    "completion_tokens": meta.get("completion_tokens", 0),
                    "total_tokens": meta.get("prompt_tokens", 0) + meta.get("completion_tokens", 0),
                },
            }
        )


RolloutFunction = Callable[[Prompt, AgentClient], Awaitable[list[Any]]]
# (engine, tokenizer, temperature, budget) -> the client of one conversation (rl/agent_turns.py)
ClientFactory = Callable[[Engine, Any, float, int], AgentClient]


def load_rollout_function(spec: str) -> RolloutFunction:
    """``builtin:calculator`` or ``package.module:function``, which must be async."""
    if spec == "builtin:calculator":
        return calculator
    module, _, name = spec.partition(":")
    function = getattr(importlib.import_module(module), name)
    if not inspect.iscoroutinefunction(function):
        raise ValueError(f"{spec} must be an async function (async def {name}(prompt, client))")
    return function


async def converse(
    function: RolloutFunction,
    prompt: Prompt,
    client: AgentClient,
    images: ImagePolicy | None = None,
) -> tuple[list[dict[str, Any]] | None, str]:
    """(the conversation, "") or (None, why it ended early: out_of_budget or failed). An error of
    the engines themselves is raised: it fails the step, as in a plain rollout. ``images``:
    gateway.images, for the images user code adds (``ConversationImages.of``)."""
    client.images = ConversationImages.of(prompt, images)
    try:
        conversation = await function(prompt, client)
    except RolloutBudgetExceeded:
        return None, "out_of_budget"
    except RejectedTrajectory:  # a turn that could not be sent as recorded: agent/rejected
        return None, "rejected"
    except Exception:  # noqa: BLE001 - the user's function failed this sample: counted
        if client.engine_error is not None:
            raise client.engine_error from None
        return None, "failed"
    if not isinstance(conversation, list):
        return None, "failed"
    return [as_dict(m) for m in conversation], ""


def generate(
    engines: EngineClients,
    prompts: list[tuple[Prompt, list[int]]],
    *,
    n: int,
    temperature: float,
    max_tokens: int,
    function: RolloutFunction,
    tokenizer: Any,
    client: ClientFactory = AgentClient,
    vision: AgentVision | None = None,
) -> list[Sample]:
    """``n`` conversations per prompt, all concurrent on the job's event loop, as samples in
    prompt order; ``max_tokens`` bounds each conversation's tokens after its prompt; ``client``
    records each (``rollout.multi_turn``); ``vision`` gives a vision-language policy's samples
    their images (``rl/agent_vision.py``)."""
    rollout = engines.client("rollout")
    clients, conversations = [], []
    for group in range(len(prompts)):
        for _ in range(n):
            key = f"g{group}"  # a prompt's conversations share an engine and its prefix cache
            engine = functools.partial(rollout.request, "/generate", affinity_key=key)
            clients.append(client(engine, tokenizer, temperature, max_tokens))
            conversations.append(converse(function, prompts[group][0], clients[-1], rollout.images))
    outcomes = engines.run(all_or_none(conversations), what=f"{len(clients)} agentic rollouts")
    samples = [
        to_sample(i // n, prompts[i // n], client, conversation, outcome)
        for i, (client, (conversation, outcome)) in enumerate(zip(clients, outcomes, strict=True))
    ]
    attach_images(vision, samples, clients, prompts, n)
    return samples


def to_sample(
    group: int,
    prompt: tuple[Prompt, list[int]],
    client: AgentClient,
    conversation: list[dict[str, Any]] | None,
    outcome: str,
) -> Sample:
    """One conversation as a sample: trained only when it was recorded exactly and did not
    fail (a conversation out of budget is trained as far as it went). With one row per turn
    (``per_turn``) the sample is the last turn's row, the earlier ones in ``earlier_turns``."""
    source, ids = prompt
    rows = client.recorded_turns()
    t = rows[-1] if rows else client.trajectory
    versions = [v for row in rows for v in row.versions]
    replies = [m for m in conversation or [] if m.get("role") == "assistant"]
    text = (replies[-1] if replies else client.reply).get("content") or ""
    sample = Sample(
        group=group,
        question=text_of(source.messages[-1]["content"]),  # a prompt with images: its text
        label=source.label,
        prompt_ids=t.prompt_ids or list(ids),
        response_ids=t.ids,
        logprobs=t.logprobs,
        text=text,
        weight_version=str(min(versions)) if versions else "None",
        finish_reason=t.finish_reason,
        data_source=source.data_source,
        meta=source.meta,
        response_mask=t.mask,
        conversation=conversation,
        scores=client.scores or None,
        turns=sum(row.turns for row in rows),
        outcome=outcome or ("rejected" if t.rejected else ""),
        earlier_turns=[TurnTokens(r.prompt_ids, r.ids, r.logprobs) for r in rows[:-1]] or None,
        prompt_images=source.images,  # a judge is shown them (rl/vision_scoring.py)
    )
    sample.valid = sample.outcome in ("", "out_of_budget") and sample.turns > 0
    return sample
