"""serving_tools: how tool_choice shapes generation and how an output becomes an assistant message, with
and without a reasoning parser; streamed deltas add up to the non-streamed message. Pure Python."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError
from pagedserve.entrypoints.openai.serving_tools import ToolOptions, ToolPlan, required_schema

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]
AUTO = ToolOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")


def plan(options: ToolOptions = AUTO, **body) -> ToolPlan:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)
    return ToolPlan.from_request(req, options)


def streamed(p: ToolPlan, text: str, cuts: list[int]) -> tuple[dict, list[dict]]:
    """Feed `text` growing at the cut points; the message the deltas add up to, and the deltas."""
    streamer = p.streamer()
    points = sorted({c for c in cuts if 0 < c < len(text)}) + [len(text)]
    deltas = [streamer.update(text[:end], end == len(text)) for end in points]
    msg: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for d in deltas:
        msg["content"] += d.get("content", "")
        msg["reasoning_content"] += d.get("reasoning_content", "")
        for call in d.get("tool_calls", []):
            got = msg["tool_calls"].setdefault(call["index"], {"name": None, "arguments": ""})
            if "id" in call:
                assert got["name"] is None, "the id and name come once, first"
                got["name"] = call["function"]["name"]
            got["arguments"] += call["function"].get("arguments", "")
    return msg, deltas


def agrees(p: ToolPlan, text: str, cuts: list[int]) -> None:
    whole, _ = p.message(text, "stop")
    got, _ = streamed(p, text, cuts)
    assert got["content"] == (whole["content"] or "")
    assert got["reasoning_content"] == (whole.get("reasoning_content") or "")
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])]
    assert [(c["name"], c["arguments"]) for c in got["tool_calls"].values()] == want


def test_choices_and_their_errors():
    assert plan().mode == "none"
    assert plan(tools=TOOLS).mode == "auto"  # vLLM's default with tools
    assert plan(tools=TOOLS, tool_choice="none").mode == "none"
    named = plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.mode == "named" and named.structured_outputs().schema() == {"type": "object"}
    with pytest.raises(OpenAIError, match="--enable-auto-tool-choice"):
        plan(ToolOptions(), tools=TOOLS)
    with pytest.raises(OpenAIError, match="only allowed when tools"):
        plan(tool_choice="auto")
    with pytest.raises(OpenAIError, match="unique"):
        plan(tools=TOOLS + TOOLS[:1], tool_choice="required")
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ToolOptions(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser: unknown parser"):
        ToolOptions(tool_call_parser="nope")


def test_required_schema_accepts_only_the_tools():
    schema = required_schema(TOOLS, parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    names = [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert all(c["additionalProperties"] is False for c in schema["items"]["anyOf"])


REQUIRED_OUT = '[\n{"name": "get_weather", "arguments": {"city": "Paris"}},\n{"name": "get_time", "arguments": {}}\n]'


def test_messages_of_each_mode():
    msg, reason = plan(tools=TOOLS, tool_choice="required").message(REQUIRED_OUT, "stop")
    assert reason == "tool_calls" and msg["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    one, _ = plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).message(REQUIRED_OUT, "stop")
    assert len(one["tool_calls"]) == 1
    cut, reason = plan(tools=TOOLS, tool_choice="required").message('[\n{"name": "get_wea', "length")
    assert reason == "length" and cut["content"] == '[\n{"name": "get_wea' and cut["tool_calls"] == []
    named = plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg, reason = named.message(' {"city": "Oslo"}', "stop")
    assert reason == "stop" and msg["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                     "arguments": '{"city": "Oslo"}'}
    auto = plan(tools=TOOLS)
    msg, reason = auto.message('Sure.<tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>', "stop")
    assert reason == "tool_calls" and msg["content"] == "Sure." and msg["tool_calls"][0]["function"]["name"] == \
        "get_time"
    msg, reason = auto.message("No tool needed.", "stop")
    assert reason == "stop" and msg["content"] == "No tool needed." and msg["tool_calls"] == []


def test_reasoning_is_split_out():
    r1 = ToolOptions(reasoning_parser="deepseek_r1")
    msg, _ = plan(r1).message("<think>Let me see.</think>The answer is 4.", "stop")
    assert msg["reasoning_content"] == "Let me see." and msg["content"] == "The answer is 4."
    both = ToolOptions(True, "hermes", "qwen3")
    text = '<think>I need the time.</think><tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>'
    msg, reason = plan(both, tools=TOOLS).message(text, "stop")
    assert msg["reasoning_content"] == "I need the time." and reason == "tool_calls" and msg["content"] is None


CASES = [
    (dict(tools=TOOLS, tool_choice="required"), ToolOptions(), REQUIRED_OUT),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}), ToolOptions(),
     '{"city": "Saint-\\u00c9tienne"}'),
    (dict(tools=TOOLS), AUTO, 'Let me check.\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome"}}]'
                              '</tool_call>\nDone.'),
    (dict(tools=TOOLS), ToolOptions(True, "hermes", "deepseek_r1"),
     'First <b>think</b>.</think>Answer: <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'),
    (dict(), ToolOptions(reasoning_parser="qwen3"), "<think>hmm</think>plain answer"),
    (dict(), ToolOptions(), "plain text, no tools"),
]


@pytest.mark.parametrize("body, options, text", CASES)
def test_streaming_adds_up_to_the_message_char_by_char(body, options, text):
    agrees(plan(options, **body), text, list(range(len(text))))


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(CASES), st.lists(st.integers(0, 200), max_size=12))
def test_streaming_adds_up_to_the_message_in_any_chunks(case, cuts):
    body, options, text = case
    agrees(plan(options, **body), text, cuts)


def test_required_arguments_grow_while_streaming():
    _, deltas = streamed(plan(tools=TOOLS, tool_choice="required"), REQUIRED_OUT, list(range(len(REQUIRED_OUT))))
    pieces = [c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", []) if c["index"] == 0]
    assert len([p for p in pieces if p]) > 5  # not one lump at the end
