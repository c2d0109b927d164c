"""A multi-turn environment with a tool in verifiers' contract (a miniature of its ToolEnv,
written without verifiers): the model may call ``add``; its result comes back as a tool
message; a reply without a tool call before any was made gets a user turn asking for one; the
rollout ends at a reply after a tool result, or at ``max_turns`` replies."""

from __future__ import annotations

import json

from tiny_env_single import Rubric, arithmetic_rows, checksum, correct_answer


def add(a: int, b: int) -> int:
    return a + b


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Adds two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
SYSTEM = "You can call the add tool. Give the final answer as a number."
NUDGE = "Call the add tool first."


class ToolEnvironment:
    def __init__(self, dataset: list[dict], rubric: Rubric, max_turns: int, max_tokens: int):
        self.dataset, self.rubric = dataset, rubric
        self.max_turns, self.max_tokens = max_turns, max_tokens

    async def run_rollout(self, input, client, model, sampling_args):
        completion: list[dict] = []
        turns = tool_results = 0
        while turns < self.max_turns:
            response = await client.chat.completions.create(
                model=model,
                messages=[*input["prompt"], *completion],
                tools=TOOLS,
                max_tokens=self.max_tokens,
                **sampling_args,
            )
            # as openai users append it: every field, the unset ones as None; a reply that is
            # only a tool call without its content, as verifiers sends it
            message = response.choices[0].message.model_dump()
            if message.get("tool_calls") and not message["content"]:
                message["content"] = None
            completion.append(message)
            turns += 1
            calls = message.get("tool_calls") or []
            if (not calls and tool_results) or turns == self.max_turns:
                break
            for call in calls:
                arguments = json.loads(call["function"]["arguments"])
                result = {"add": add}[call["function"]["name"]](**arguments)
                completion.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": str(result)}
                )
                tool_results += 1
            if not calls:
                completion.append({"role": "user", "content": NUDGE})
        reward = await self.rubric.score(completion, input["answer"])
        return {"example_id": input["example_id"], "completion": completion, "reward": reward}


def load_environment(
    size: int = 8,
    seed: int = 0,
    max_turns: int = 3,
    max_tokens: int = 32,
    checksum_weight: float = 0.0,
):
    rubric = Rubric([correct_answer, checksum], [1.0, checksum_weight])
    return ToolEnvironment(arithmetic_rows(size, seed, SYSTEM), rubric, max_turns, max_tokens)
