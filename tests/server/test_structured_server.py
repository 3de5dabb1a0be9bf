"""Structured outputs and tool calling through the OpenAI server, with the official `openai` client, on the
bundled model (float32): response_format (pydantic models through `parse`), vLLM's structured_outputs and
guided_* fields on both endpoints, tool_choice required / named / auto with the hermes parser, streamed
and not, and the 400s for bad specs."""

from __future__ import annotations

import asyncio
import enum
import json
import re
import signal

import httpx
import pytest
from pydantic import BaseModel, Field

openai = pytest.importorskip("openai")

from live_server import start_server  # noqa: E402

from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.engine.engine import LLMEngine  # noqa: E402
from pagedserve.entrypoints.openai.api_server import build_app  # noqa: E402
from pagedserve.entrypoints.openai.serving_tools import ToolOptions  # noqa: E402

pytestmark = pytest.mark.slow


class Mood(enum.StrEnum):
    happy = "happy"
    sad = "sad"
    calm = "calm"


class Pet(BaseModel):
    kind: str = Field(max_length=16)
    legs: int


class Character(BaseModel):
    name: str = Field(max_length=20)
    mood: Mood
    pets: list[Pet] = Field(max_length=2)


class WeatherArgs(BaseModel):
    city: str = Field(max_length=30)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


class TimeArgs(BaseModel):
    timezone: str = Field(max_length=30)


def _strict(schema: dict) -> dict:
    return {**schema, "additionalProperties": False}


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                      "parameters": _strict(WeatherArgs.model_json_schema())}},
    {"type": "function", "function": {"name": "get_time", "description": "The current time in a timezone",
                                      "parameters": _strict(TimeArgs.model_json_schema())}},
]
ARGS_MODEL = {"get_weather": WeatherArgs, "get_time": TimeArgs}


@pytest.fixture(scope="module")
def live():
    engine = LLMEngine(EngineConfig(dtype="float32"))
    # qwen3's reasoning parser only acts on outputs that open with <think>: the other tests' outputs pass as
    # they are.
    app = build_app(engine, tool_options=ToolOptions(enable_auto_tool_choice=True, tool_call_parser="hermes",
                                                     reasoning_parser="qwen3"))
    server, thread, url = start_server(app, timeout_graceful_shutdown=5)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    client.base_root = url
    yield engine, client, aclient
    server.handle_exit(signal.SIGTERM, None)
    thread.join(30)
    assert not thread.is_alive()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_parse_gives_a_valid_instance_20_of_20(live):
    engine, _, aclient = live
    subjects = ["a pirate", "a baker", "a robot", "a wizard", "a gardener"]

    async def one(i: int):
        return await aclient.chat.completions.parse(
            model=engine.served_model_name, messages=user(f"Invent {subjects[i % 5]} character, number {i}."),
            response_format=Character, temperature=0.7, seed=1000 + i, max_tokens=200)

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(20)))

    results = asyncio.run(all_of_them())
    parsed = [r.choices[0].message.parsed for r in results]
    assert all(isinstance(p, Character) for p in parsed)
    assert len({r.choices[0].message.content for r in results}) > 1  # different seeds, different answers
    assert engine.structured.backend.num_cached() >= 1


def _closed(schema):
    """Every object of the schema takes only its own properties (what OpenAI's strict mode asks for)."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if out.get("type") == "object":
            out["additionalProperties"] = False
        return out
    return [_closed(s) for s in schema] if isinstance(schema, list) else schema


def test_schema_regex_choice_on_both_endpoints(live):
    engine, client, _ = live
    schema = _closed(Character.model_json_schema())
    r = client.chat.completions.create(
        model=engine.served_model_name, messages=user("A character as JSON"), temperature=0, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "character", "schema": schema}})
    Character.model_validate_json(r.choices[0].message.content)
    r = client.chat.completions.create(model=engine.served_model_name, messages=user(
        'Give a JSON object with the keys "city" and "country" for Paris.'),
                                       temperature=0, max_tokens=200, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    date = r"\d{4}-\d{2}-\d{2}"
    r = client.chat.completions.create(model=engine.served_model_name, messages=user("When was the moon landing?"),
                                       temperature=0, max_tokens=20, extra_body={"structured_outputs": {"regex": date}})
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r.choices[0].message.content)
    r = client.completions.create(model=engine.served_model_name, prompt="The best season is", temperature=0,
                                  max_tokens=8, extra_body={"guided_choice": ["summer", "winter"]})
    assert r.choices[0].text in ("summer", "winter")
    r = client.completions.create(model=engine.served_model_name, prompt="Answer in JSON:", temperature=0,
                                  max_tokens=200, extra_body={"structured_outputs": {
                                      "json": Character.model_json_schema(), "disable_additional_properties": True}})
    Character.model_validate_json(r.choices[0].text)
    # Streamed: the chunks add up to a text that follows the regex.
    stream = client.completions.create(model=engine.served_model_name, prompt="Today is", temperature=0.5, seed=5,
                                       max_tokens=20, stream=True, extra_body={"guided_regex": date})
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", "".join(c.choices[0].text for c in stream))


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "invalid json"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "invalid regex"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar", "invalid grammar"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools", "invalid json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "one structured-output constraint"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "unknown field"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
])
def test_bad_specs_are_400(live, body, param, words):
    engine, client, _ = live
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=engine.served_model_name, messages=user("hi"), max_tokens=5,
                                       extra_body=body)
    err = e.value.body
    assert e.value.status_code == 400 and words in err["message"], err
    assert err["param"] == param and err["message"].startswith(param), err
    assert engine.stats().num_running == 0


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        ARGS_MODEL[call.function.name].model_validate_json(call.function.arguments)


def _streamed(stream) -> tuple[str, dict[int, dict], str | None]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert call["id"] is None, "a call's id comes once, in its first delta"
                call["id"], call["name"] = d.id, d.function.name
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_required_and_named_tool_choice_always_parse(live):
    engine, client, _ = live
    model = engine.served_model_name
    for i, question in enumerate(["What's the weather in Paris?", "Time in Tokyo?", "Tell me a joke."]):
        r = client.chat.completions.create(model=model, messages=user(question), tools=TOOLS, tool_choice="required",
                                           temperature=0.7, seed=i, max_tokens=120)
        assert r.choices[0].finish_reason == "tool_calls"
        _check_calls(r.choices[0].message.tool_calls)
        named = {"type": "function", "function": {"name": "get_time"}}
        r = client.chat.completions.create(model=model, messages=user(question), tools=TOOLS, tool_choice=named,
                                           temperature=0.7, seed=i, max_tokens=120)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_time" and r.choices[0].finish_reason == "stop"
        _check_calls([call])
    # Streamed (greedy): the deltas add up to the non-streamed calls, arguments growing piece by piece.
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kwargs = dict(model=model, messages=user("Weather in Oslo, in celsius?"), tools=TOOLS, tool_choice=choice,
                      temperature=0, max_tokens=120)
        whole = client.chat.completions.create(**kwargs).choices[0]
        content, calls, finish = _streamed(client.chat.completions.create(**kwargs, stream=True))
        want = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert [(c["name"], c["arguments"]) for c in calls.values()] == want
        assert finish == whole.finish_reason and content == ""


def test_a_two_turn_tool_conversation(live):
    """The model calls a tool, gets its result, and answers; streamed and not, the same greedy turns."""
    engine, client, _ = live
    model = engine.served_model_name
    messages = user("What is the weather in Paris in celsius?")
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=120).choices[0]
    _check_calls(first.message.tool_calls)
    call = first.message.tool_calls[0]
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0,
                                            max_tokens=60).choices[0]
    message = second.message
    if message.tool_calls:  # auto: the hermes parser found a call in the answer
        assert second.finish_reason == "tool_calls"
        _check_calls(message.tool_calls)
    else:
        assert message.content and "<tool_call>" not in message.content
    content, calls, finish = _streamed(client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=60, stream=True))
    assert content == (message.content or "") and finish == second.finish_reason
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls or []]
    # The tool result reached the prompt through the tool-aware template.
    tokens = httpx.post(f"{client.base_root}/tokenize", json={"messages": messages}).json()["tokens"]
    prompt = engine.tokenizer.decode(tokens, skip_special_tokens=False)
    assert '"sky": "sunny"' in prompt and '"name": "get_weather"' in prompt


def test_auto_parses_hermes_calls_in_the_output(live, monkeypatch):
    """A model that answers in the hermes list form gets message.tool_calls (the output is forced with a
    regex so the test does not depend on what the small model chooses to say)."""
    engine, client, _ = live
    forced = r'<tool_call>\[\{"name": "get_time", "arguments": \{"timezone": "UTC"\}\}\]</tool_call>'
    r = client.chat.completions.create(model=engine.served_model_name, messages=user("Time?"), tools=TOOLS,
                                       tool_choice="auto", temperature=0, max_tokens=60,
                                       extra_body={"structured_outputs": {"regex": forced}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"timezone": "UTC"}


def test_reasoning_content_is_split_out(live):
    """--reasoning-parser qwen3: <think>...</think> goes to reasoning_content, streamed and not (the output
    is forced with a regex: the bundled model does not think on its own)."""
    engine, client, _ = live
    forced = r"<think>[a-z]{2,8}( [a-z]{2,8}){1,3}</think>[A-Z][a-z]{2,10}( [a-z]{2,8}){1,3}\."
    kwargs = dict(model=engine.served_model_name, messages=user("Think, then answer: is the sky blue?"),
                  temperature=0, max_tokens=60, extra_body={"structured_outputs": {"regex": forced}})
    message = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert re.fullmatch(r"[a-z]{2,8}( [a-z]{2,8}){1,3}", reasoning)
    assert re.fullmatch(r"[A-Z][a-z]{2,10}( [a-z]{2,8}){1,3}\.", message.content)
    streamed_reasoning, streamed_content = "", ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        streamed_reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        streamed_content += delta.content or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, message.content)
