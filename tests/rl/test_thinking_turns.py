"""Thinking models over many turns (``rollout.multi_turn``, ``rl/agent_turns.py``), with the
real tokenizer configuration and chat template of Qwen3, Qwen2.5 and Llama 3.1 (over a tiny
vocabulary: tests/rl/template_tokenizers.py) and a scripted engine that answers with the
tokenizer's own ids: a question, a tool call and its result, the answer, a follow-up question.

Qwen3's template drops the earlier turns' <think> blocks once the follow-up comes, so what the
engine saw and what the template renders differ. Before ``rollout.multi_turn`` (today's
``strict``) such a conversation was rejected (``agent/rejected``); now it is trained exactly,
either as the engine's own tokens (``continue_tokens``) or one row per turn with the context the
template renders at inference (``per_turn``)."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest
import tiny_agent
from template_tokenizers import FAMILIES, tokenizer_of
from thinking_agent import think_call_follow_up
from tiny_agent import CALCULATOR

from relax_launch.config import ConfigError, load_config
from relax_launch.rl import agent
from relax_launch.rl.agent_turns import client_factory
from relax_launch.rl.batch import sample_metrics, to_batch
from relax_launch.rl.data import Prompt

QUESTION = Prompt(0, ({"role": "user", "content": "What is 3 + 4?"},), "7")
THOUGHT = "I need the calculator."
REPLIES = (
    f"<think>\n{THOUGHT}\n</think>\n\n<tool_call>\n"
    '{"name": "calculator", "arguments": {"expression": "3+4"}}\n</tool_call>',
    "<think>\nThe calculator says 7.\n</think>\n\nThe answer is 7.",
    "<think>\nAdd one.\n</think>\n\n8",
)
AGENTIC = Path(__file__).parent / "agentic_tiny.yaml"


class ScriptedEngine:
    """Answers with the replies' token ids and the family's stop token, each token with its own
    logprob; ``text`` as SGLang returns it (special tokens skipped)."""

    def __init__(self, tokenizer, replies=REPLIES) -> None:
        self.tokenizer, self.replies, self.requests, self.outputs = tokenizer, list(replies), [], []

    async def __call__(self, body):
        self.requests.append(body["input_ids"])
        eos = self.tokenizer.eos_token_id
        ids = self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False) + [eos]
        finish = {"type": "stop", "matched": eos}
        wanted = body["sampling_params"]["max_new_tokens"]
        if len(ids) > wanted:  # as an engine does: cut at max_new_tokens
            ids, finish = ids[:wanted], {"type": "length", "length": wanted}
        self.outputs.append(ids)
        logprobs = [[-0.01 * (len(self.requests) + k), i, None] for k, i in enumerate(ids)]
        meta = {"output_token_logprobs": logprobs, "finish_reason": finish}
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return {"text": text, "output_ids": ids, "meta_info": meta | {"weight_version": "2"}}


def converse(family: str, multi_turn: str, function=think_call_follow_up, budget: int = 600):
    tokenizer = tokenizer_of(family)
    engine = ScriptedEngine(tokenizer)
    client = client_factory(multi_turn)(engine, tokenizer, 1.0, budget)
    conversation, outcome = asyncio.run(agent.converse(function, QUESTION, client))
    sample = agent.to_sample(0, (QUESTION, []), client, conversation, outcome)
    return tokenizer, engine, client, conversation, sample


def inference_context(tokenizer, conversation: list[dict], turn: int) -> list[int]:
    """The ids an OpenAI-compatible server gives the model before assistant reply ``turn``:
    the template's own tokenisation of the messages before it, tool calls' arguments parsed
    into objects first (SGLang's serving_chat.normalize_assistant_tool_call_arguments)."""
    replies = [i for i, m in enumerate(conversation) if m["role"] == "assistant"]
    before = copy.deepcopy(conversation[: replies[turn]])
    for message in before:
        for call in message.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    encoded = tokenizer.apply_chat_template(
        before, tools=[CALCULATOR], add_generation_prompt=True, tokenize=True
    )
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def logprobs(engine: ScriptedEngine, turn: int) -> list[float]:
    return [-0.01 * (turn + 1 + k) for k in range(len(engine.outputs[turn]))]


def test_qwen3s_template_drops_the_thinking_the_engine_saw():
    tokenizer, engine, _, conversation, _ = converse("qwen3", "continue_tokens")
    saw = tokenizer.decode(engine.requests[2])
    rendered = tokenizer.decode(inference_context(tokenizer, conversation, 2))
    assert THOUGHT in saw and THOUGHT not in rendered  # the follow-up drops it at inference
    # while the tool call is answered (no new user question) the template keeps it
    assert THOUGHT in tokenizer.decode(inference_context(tokenizer, conversation, 1))


def test_before_a_thinking_conversation_on_qwen3_was_rejected():
    """Today's behaviour, kept as ``strict``: the sample is rejected and not trained."""
    tokenizer, engine, client, conversation, sample = converse("qwen3", "strict")
    assert sample.outcome == "rejected" and not sample.valid
    assert client.trajectory.rejected == "the chat template rewrites earlier turns"
    assert sample_metrics([sample], 1.0)["agent/rejected"] == 1
    assert not any(any(row) for row in to_batch([sample], 0.0).loss_mask)
    # from the follow-up on, the engine was given the template's rendering afresh
    assert engine.requests[2] == inference_context(tokenizer, conversation, 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_continue_tokens_trains_exactly_the_context_the_engine_saw(family):
    tokenizer, engine, client, conversation, sample = converse(family, "continue_tokens")
    assert sample.valid and sample.outcome == "" and sample.turns == 3
    assert conversation[1]["tool_calls"] and conversation[-1]["content"].endswith("8")
    assert all(output[-1] == tokenizer.eos_token_id for output in engine.outputs)  # not cut
    assert sample_metrics([sample], 1.0)["agent/rejected"] == 0
    requests, outputs = engine.requests, engine.outputs
    assert requests[0] == sample.prompt_ids == inference_context(tokenizer, conversation, 0)
    for turn in (1, 2):  # every turn continues the previous context and reply, token for token
        before = requests[turn - 1] + outputs[turn - 1]
        assert requests[turn][: len(before)] == before
    # the trained sequence is the engine's last context and reply
    assert sample.prompt_ids + sample.response_ids == requests[2] + outputs[2]
    mask = sample.response_mask
    produced = [t for t, m in zip(sample.response_ids, mask, strict=True) if m]
    assert produced == outputs[0] + outputs[1] + outputs[2]
    trained_logprobs = [lp for lp, m in zip(sample.logprobs, mask, strict=True) if m]
    assert trained_logprobs == pytest.approx([lp for t in range(3) for lp in logprobs(engine, t)])
    masked = tokenizer.decode([t for t, m in zip(sample.response_ids, mask, strict=True) if not m])
    assert "7" in masked and "And 7 + 1?" in masked  # the tool result and the follow-up
    if family == "qwen3":  # the engine saw its own thinking, which inference would not show
        assert THOUGHT in tokenizer.decode(requests[2])
        assert requests[2] != inference_context(tokenizer, conversation, 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_per_turn_trains_each_turn_with_the_inference_context(family):
    tokenizer, engine, client, conversation, sample = converse(family, "per_turn")
    assert sample.valid and sample.outcome == "" and sample.turns == 3
    assert conversation[1]["tool_calls"] and conversation[-1]["content"].endswith("8")
    assert all(output[-1] == tokenizer.eos_token_id for output in engine.outputs)  # not cut
    metrics = sample_metrics([sample], 1.0)
    assert metrics["agent/rejected"] == 0 and metrics["agent/turns"] == 3
    assert metrics["response_tokens"] == sum(len(o) for o in engine.outputs)
    for turn in range(3):  # each turn was generated from the template's own tokenisation
        assert engine.requests[turn] == inference_context(tokenizer, conversation, turn)
    sample.advantage = 0.5
    batch = to_batch([sample], 0.0)
    assert len(batch.tokens) == 3  # one row per turn, each exactly what the engine saw and made
    for turn, (tokens, mask, weights, old) in enumerate(
        zip(batch.tokens, batch.loss_mask, batch.token_weights, batch.old_logprobs, strict=True)
    ):
        context, output = engine.requests[turn], engine.outputs[turn]
        assert list(tokens) == context + output
        assert list(mask) == [0.0] * len(context) + [1.0] * len(output)
        assert list(weights) == [0.0] * len(context) + [0.5] * len(output)
        assert list(old[len(context) :]) == pytest.approx(logprobs(engine, turn))
    if family == "qwen3":  # the last turn's context no longer holds the first turn's thinking
        assert THOUGHT in tokenizer.decode(batch.tokens[1])
        assert THOUGHT not in tokenizer.decode(batch.tokens[2])


def test_per_turn_rows_still_split_like_the_samples():
    """Rows without loss make the rows a multiple of the samples (which the config splits over
    data-parallel ranks and micro-batches)."""
    _, _, _, _, sample = converse("qwen3", "per_turn")
    _, _, _, _, other = converse("llama3_1", "per_turn", tiny_agent.edits_the_reply)
    batch = to_batch([sample, other], 0.0)  # 3 + 2 turns
    assert len(batch.tokens) == 6 and len(batch.tokens[5]) == 2 and not any(batch.loss_mask[5])
    assert sum(sum(mask) for mask in batch.loss_mask) == sum(
        len(r)
        for s in (sample, other)
        for r in [s.response_ids, *(t.response_ids for t in s.earlier_turns)]
    )


def test_per_turn_trains_a_conversation_that_edits_a_reply():
    """Each turn stands alone, so nothing is rejected (continue_tokens rejects this one)."""
    _, engine, _, _, sample = converse("qwen2_5", "per_turn", tiny_agent.edits_the_reply)
    assert sample.valid and sample.turns == 2
    assert len(to_batch([sample], 0.0).tokens) == 2
    _, _, _, _, rejected = converse("qwen2_5", "continue_tokens", tiny_agent.edits_the_reply)
    assert rejected.outcome == "rejected"


def test_per_turn_budget_bounds_each_row_beyond_the_first_prompt():
    _, engine, client, _, sample = converse("qwen3", "per_turn", budget=40)
    assert sample.outcome == "out_of_budget" and sample.valid  # trained as far as it went
    first = len(engine.requests[0])
    for tokens in to_batch([sample], 0.0).tokens:
        assert len(tokens) <= first + 40
    assert sample.turns == len(engine.requests) < 3


def test_multi_turn_is_refused_where_it_cannot_act():
    assert load_config(AGENTIC).rollout.multi_turn == "continue_tokens"
    load_config(AGENTIC, ["rollout.multi_turn=per_turn"])
    with pytest.raises(ConfigError, match="there is no rollout.function"):
        load_config(AGENTIC, ["rollout.function=null", "rollout.multi_turn=strict"])
    with pytest.raises(ConfigError, match="max_staleness=0"):
        load_config(AGENTIC, ["rollout.multi_turn=per_turn", "algorithm.max_staleness=1"])
    load_config(AGENTIC, ["rollout.multi_turn=strict", "algorithm.max_staleness=1"])
