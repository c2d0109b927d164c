"""Rollout functions for the agentic tests: two turns around a tool result, whatever the tiny
random model writes (it never calls the tool on its own)."""

from __future__ import annotations

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


async def two_turns(prompt, client):
    messages = list(prompt.messages)
    first = await client.chat.completions.create(
        messages=messages, tools=[CALCULATOR], max_tokens=5
    )
    messages.append(first.choices[0].message)  # an openai message object, as users append it
    messages.append({"role": "tool", "tool_call_id": "call_0", "content": "Result: 7"})
    second = await client.chat.completions.create(
        messages=messages, tools=[CALCULATOR], max_tokens=5
    )
    messages.append(second.choices[0].message)
    return messages


async def edits_the_reply(prompt, client):
    """Puts back another assistant text than the one it got: the tokens cannot be trained."""
    messages = list(prompt.messages)
    first = await client.chat.completions.create(messages=messages, max_tokens=3)
    messages.append({"role": "assistant", "content": first.choices[0].message.content + "!"})
    messages.append({"role": "user", "content": "Go on."})
    await client.chat.completions.create(messages=messages, max_tokens=3)
    return messages


async def two_long_turns(prompt, client):
    """two_turns with longer replies: a sync is likelier to interrupt one (the async job)."""
    messages = list(prompt.messages)
    for _ in range(2):
        reply = await client.chat.completions.create(messages=messages, max_tokens=40)
        messages += [reply.choices[0].message, {"role": "user", "content": "Go on."}]
    return messages[:-1]
