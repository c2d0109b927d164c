"""How an agentic conversation becomes training data (``rollout.multi_turn``).

A chat template may render earlier turns otherwise once the conversation goes on: Qwen3's drops
the ``<think>`` blocks of the assistant turns before the last user message. The tokens the
engine saw are then not the tokens the template renders, and one sequence cannot be both. Each
choice trains exactly what the engine produced, from the context it was produced from:

- ``continue_tokens`` (``AgentClient``): every turn continues the engine's own tokens; the sample
  is one sequence, the context the engine really saw (earlier thinking kept).
- ``per_turn`` (``PerTurnClient``): every turn is generated from the template's rendering of
  the conversation, as at inference; each turn is a row of its own (context masked, the
  engine's tokens trained), all with the conversation's reward and advantage.
- ``strict``: ``continue_tokens`` that rejects a conversation whose template rewrites earlier
  turns (``agent/rejected``): one sequence that is also the inference context, or nothing.
"""

from __future__ import annotations

import functools
from typing import Any

from relax_launch.rl.agent import AgentClient, ClientFactory, Engine, Trajectory


class PerTurnClient(AgentClient):
    """Each call is generated from the template's rendering of the messages it is given (the
    context an OpenAI-compatible server builds at inference), recorded as a turn of its own. A
    conversation need not extend the previous one: nothing is ever rejected. The budget bounds
    each turn's context beyond the first prompt plus its reply, so no row is longer than the
    first prompt and ``data.max_response_tokens``."""

    def __init__(self, engine: Engine, tokenizer: Any, temperature: float, budget: int) -> None:
        super().__init__(engine, tokenizer, temperature, budget)
        self.turns: list[Trajectory] = []  # each call's context and reply
        self.first_prompt: int | None = None  # tokens of the first call's context

    def _context(self, conversation: list[dict[str, Any]], tools: Any) -> tuple[list[int], int]:
        text = self.render(conversation, tools, generate=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if self.first_prompt is None:
            self.first_prompt = len(ids)
        left = self.budget - max(0, len(ids) - self.first_prompt)
        if left > 0:  # this turn is generated: it is recorded from here
            self.trajectory = Trajectory(prompt_ids=ids)
            self.turns.append(self.trajectory)
        return ids, left

    def recorded_turns(self) -> list[Trajectory]:
        """Every turn the engine answered, in order."""
        return [turn for turn in self.turns if turn.turns]


def client_factory(multi_turn: str) -> ClientFactory:
    """The client recording each conversation under ``rollout.multi_turn``."""
    if multi_turn == "per_turn":
        return PerTurnClient
    return functools.partial(AgentClient, strict=multi_turn == "strict")
