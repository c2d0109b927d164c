"""The rollout function of the thinking-model tests: a question, a tool call and its result,
the answer, then a follow-up question from the user and its answer (three turns). A thinking
model's chat template (Qwen3's) drops the earlier turns' <think> blocks once the follow-up
comes: what the engine saw and what the template renders then differ."""

from __future__ import annotations

from tiny_agent import CALCULATOR

FOLLOW_UP = "And 7 + 1?"


async def think_call_follow_up(prompt, client):
    messages = list(prompt.messages)
    first = await client.chat.completions.create(
        messages=messages, tools=[CALCULATOR], max_tokens=80
    )
    messages.append(first.choices[0].message)
    messages.append({"role": "tool", "tool_call_id": "call_0", "content": "7"})
    second = await client.chat.completions.create(
        messages=messages, tools=[CALCULATOR], max_tokens=80
    )
    messages += [second.choices[0].message, {"role": "user", "content": FOLLOW_UP}]
    third = await client.chat.completions.create(
        messages=messages, tools=[CALCULATOR], max_tokens=80
    )
    messages.append(third.choices[0].message)
    return messages
