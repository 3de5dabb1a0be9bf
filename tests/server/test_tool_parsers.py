"""Tool-call parsers (pagedserve/entrypoints/openai/tool_parsers.py), no model needed: realistic outputs of
each format against the expected calls and content, and the streaming layer against the non-streaming
answer under random chunkings (the deltas must add up to exactly that answer, ids included)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    PartialParse,
    PartialToolCall,
    ToolCall,
    ToolCallStreamer,
    ToolParser,
    get_tool_parser,
    register_tool_parser,
)

W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
T = '{"name": "get_time", "arguments": {"tz": "UTC"}}'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "scale": {"type": "number"},
                                     "opts": {"type": "object"}, "tags": {"type": ["array", "null"]}}}}}]
PARIS = {"city": "Paris"}
XW = "<tool_call>\n<function=get_weather>\n"  # a qwen3_xml call of get_weather, opened
MARKUP = re.compile(r"<tool_|<function|\[TOOL_")

# (parser, text, content, [(name, arguments as parsed JSON)])
EXAMPLES = [
    ("hermes", f"<tool_call>\n{W}\n</tool_call>", None, [("get_weather", PARIS)]),
    ("hermes", f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>", None,
     [("get_weather", PARIS), ("get_time", {"tz": "UTC"})]),
    ("hermes", f"Let me check that.\n<tool_call>\n{W}\n</tool_call>", "Let me check that.\n", [("get_weather", PARIS)]),
    ("hermes", f"<tool_call>\n[{W}, {T}]\n</tool_call>", None, [("get_weather", PARIS), ("get_time", {"tz": "UTC"})]),
    ("hermes", f"<tool_call>\n{W}\n", None, [("get_weather", PARIS)]),  # stopped at EOS before the close tag
    ("hermes", f"<tool_call>\n{W}</tool_", None, [("get_weather", PARIS)]),  # close tag cut off
    ("hermes", f"<tool_call>{W}\n<tool_call>{T}</tool_call>", None,  # close tag forgotten
     [("get_weather", PARIS), ("get_time", {"tz": "UTC"})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}', '<tool_call>{"name": "f", "arguments": {"a": 1}', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', []),
    ("hermes", f"<tool_call>{W}</tool_call>\n<tool_call>{{broken</tool_call>", "\n<tool_call>{broken</tool_call>",
     [("get_weather", PARIS)]),
    ("hermes", '<tool_call>{"name": "search", "parameters": {"q": "Zürich ☀ 東京", "n": [1, 2.5, null]}}</tool_call>',
     None, [("search", {"q": "Zürich ☀ 東京", "n": [1, 2.5, None]})]),
    ("hermes", '<tool_call>{"name": "now"}</tool_call>', None, [("now", {})]),
    ("hermes", f"<tool_call>{W} and then some</tool_call>", f"<tool_call>{W} and then some</tool_call>", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', []),
    ("hermes", f"<tool_call>{W}</tool_call>\nDone, see above.", "\nDone, see above.", [("get_weather", PARIS)]),
    ("hermes", "The weather in Paris is sunny. Use <tool_ tags sparingly.",
     "The weather in Paris is sunny. Use <tool_ tags sparingly.", []),
    ("hermes", "It ends with <tool_", "It ends with <tool_", []),
    ("hermes", "\n\n", None, []),
    ("hermes", '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>', None, [("unknown_tool", {})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", PARIS)]),
    ("llama3_json", f"<|python_tag|>{W}", None, [("get_weather", PARIS)]),
    ("llama3_json", f"\n {W}; {T}", None, [("get_weather", PARIS), ("get_time", {"tz": "UTC"})]),
    ("llama3_json", f"{W};\n{T};", None, [("get_weather", PARIS), ("get_time", {"tz": "UTC"})]),
    ("llama3_json", f"{W}\n\nI asked for the weather.", "I asked for the weather.", [("get_weather", PARIS)]),
    ("llama3_json", f"{W}; {{broken", "{broken", [("get_weather", PARIS)]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", '{"name": "f", "parameters": {"a": }}', '{"name": "f", "parameters": {"a": }}', []),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}', '{"name": "f", "parameters": {"a": 1}', []),
    ("llama3_json", "Paris is sunny {today}.", "Paris is sunny {today}.", []),
    ("llama3_json", '{"name": "say", "parameters": {"text": "héllo \\u00e9 😀"}}', None,
     [("say", {"text": "héllo é 😀"})]),
    ("llama3_json", "<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("mistral", f"[TOOL_CALLS] [{W}]", None, [("get_weather", PARIS)]),
    ("mistral", f"[TOOL_CALLS][{W}, {T}]", None, [("get_weather", PARIS), ("get_time", {"tz": "UTC"})]),
    ("mistral", f"Sure, checking.[TOOL_CALLS] [{W}]", "Sure, checking.", [("get_weather", PARIS)]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{"tz": "UTC"}', None,
     [("get_weather", PARIS), ("get_time", {"tz": "UTC"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}', None, [("get_weather", {"city": "Zürich"})]),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {]', '[TOOL_CALLS] [{"name": "f", "arguments": {]', []),
    ("mistral", "Ok. [TOOL_CALLS]get_weather", "Ok. [TOOL_CALLS]get_weather", []),
    ("mistral", "No tools needed: it is sunny [TOOL_", "No tools needed: it is sunny [TOOL_", []),
    ("qwen3_xml", XW + "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
     "</parameter>\n</function>\n</tool_call>", None, [("get_weather", {"city": "Paris", "days": 3})]),
    ("qwen3_xml", "I'll look.\n" + XW + "<parameter=city>\nParis\n</parameter>\n</function>\n"
     "</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>",
     "I'll look.\n", [("get_weather", PARIS), ("get_time", {"tz": "UTC"})]),
    ("qwen3_xml", XW + "<parameter=metric>\ntrue\n</parameter>\n<parameter=scale>\n2.5\n"
     "</parameter>\n<parameter=opts>\n{\"a\": [1]}\n</parameter>\n<parameter=tags>\n[\"x\"]\n</parameter>\n"
     "<parameter=days>\nthree\n</parameter>\n<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>", None,
     [("get_weather", {"metric": True, "scale": 2.5, "opts": {"a": [1]}, "tags": ["x"], "days": "three",
                       "extra": "7"})]),
    ("qwen3_xml", "<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n<parameter=content>\n"
     "def f():\n    return '<b>ü</b>'\n\n</parameter>\n</function>\n</tool_call>", None,
     [("write_file", {"path": "/tmp/a.py", "content": "def f():\n    return '<b>ü</b>'\n"})]),
    ("qwen3_xml", XW + "<parameter=city>\nParis\n</parameter>\n", None,
     [("get_weather", PARIS)]),  # cut off: the open call still counts
    ("qwen3_xml", XW + "<parameter=city>\nPar", None, [("get_weather", {"city": "Par"})]),
    ("qwen3_xml", XW + "<parameter=city>Paris<parameter=days>2</function>", None,
     [("get_weather", {"city": "Paris", "days": 2})]),
    ("qwen3_xml", "<tool_call>\n<function=a>\n</function>\n<function=b>\n<parameter=x>\n1\n</parameter>\n</function>\n"
     "</tool_call>", None, [("a", {}), ("b", {"x": "1"})]),
    ("qwen3_xml", "<tool_call>\nno function here\n</tool_call>", "<tool_call>\nno function here\n</tool_call>", []),
    ("qwen3_xml", "<tool_call>\n<function=get_weather", "<tool_call>\n<function=get_weather", []),
    ("qwen3_xml", "Plain answer, no tools.", "Plain answer, no tools.", []),
]
IDS = [f"{i}-{name}" for i, (name, *_) in enumerate(EXAMPLES)]


def make(name: str) -> ToolParser:
    return get_tool_parser(name)(TOOLS)


@pytest.mark.parametrize(("name", "text", "content", "calls"), EXAMPLES, ids=IDS)
def test_extract(name, text, content, calls):
    got = make(name).extract_tool_calls(text)
    assert got.content == content
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == calls
    assert got.tools_called == bool(calls)
    for call in got.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)
        assert call.to_openai() == {"id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": call.arguments}}
        id_format = r"[A-Za-z0-9]{9}" if name == "mistral" else r"call_[0-9a-f]{24}"
        assert re.fullmatch(id_format, call.id)
    assert len({c.id for c in got.tool_calls}) == len(got.tool_calls)


def test_arguments_keep_the_models_json_text():
    raw = '{"q":  "Zürich",\n "n": [1,2]}'
    call, = make("hermes").extract_tool_calls(f'<tool_call>{{"name": "s", "arguments": {raw}}}</tool_call>').tool_calls
    assert call.arguments == raw
    call, = make("qwen3_xml").extract_tool_calls("<tool_call><function=s><parameter=q>Zürich</parameter>"
                                                 "</function></tool_call>").tool_calls
    assert call.arguments == '{"q": "Zürich"}'  # json.dumps, ensure_ascii=False


def test_qwen3_xml_without_tools_keeps_strings():
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    call, = get_tool_parser("qwen3_xml")().extract_tool_calls(text).tool_calls
    assert call.arguments == '{"days": "3"}'


def test_partial_holds_back_markers_and_open_blocks():
    hermes = make("hermes")
    assert hermes.parse_partial("Hi <tool_") == PartialParse("Hi ", [])
    assert hermes.parse_partial("Hi <tool_call>\n{\"name\": \"get_weather\"") == PartialParse("Hi ", [])
    assert hermes.parse_partial(f"Hi <tool_call>{W}") == PartialParse("Hi ", [])  # the block may still break
    assert hermes.parse_partial(f"Hi <tool_call>{W}</tool_call>").calls == [
        PartialToolCall("get_weather", '{"city": "Paris"}', True)]
    assert make("mistral").parse_partial("Ok [TOOL_CA").content == "Ok "
    assert make("llama3_json").parse_partial("<|python").content == ""


def test_qwen3_xml_streams_arguments_by_parameter():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>")
    parser = make("qwen3_xml")
    seen = []
    for end in range(len(text) + 1):
        calls = parser.parse_partial(text[:end]).calls
        if calls and (not seen or seen[-1] != calls[0].arguments):
            seen.append(calls[0].arguments)
    assert seen == ["{", '{"city": "Paris"', '{"city": "Paris", "days": 3', '{"city": "Paris", "days": 3}']


def stream(name: str, text: str, cuts: list[int]) -> None:
    """Feed text[:cut] for each cut, then the whole text with final=True; check every delta's shape and
    that the totals equal the non-streaming answer of the same parser (so ids match too)."""
    parser = make(name)
    want = parser.extract_tool_calls(text)
    want_content = want.content or ""
    streamer = ToolCallStreamer(parser)
    content, calls = "", []
    steps = [(text[:cut], False) for cut in sorted(set(cuts))] + [(text, True)]
    for prefix, final in steps:
        delta, deltas = streamer.update(prefix, final=final)
        content += delta
        assert want_content.startswith(content), (prefix, content)
        # No fragment of a call's markup is ever shown, unless the final answer has it as content too.
        assert not MARKUP.search(content) or MARKUP.search(want_content), (prefix, content)
        for d in deltas:
            if d["index"] == len(calls):
                assert set(d) == {"index", "id", "type", "function"} and d["type"] == "function"
                assert set(d["function"]) == {"name", "arguments"} and d["function"]["arguments"] == ""
                calls.append([d["id"], d["function"]["name"], ""])
            else:
                assert d["index"] < len(calls) and set(d) == {"index", "function"}
                assert set(d["function"]) == {"arguments"} and d["function"]["arguments"]
                calls[d["index"]][2] += d["function"]["arguments"]
    assert content == want_content
    assert calls == [[c.id, c.name, c.arguments] for c in want.tool_calls]
    assert streamer.tools_called == want.tools_called


@pytest.mark.parametrize(("name", "text", "content", "calls"), EXAMPLES, ids=IDS)
def test_stream_char_by_char(name, text, content, calls):
    stream(name, text, list(range(len(text) + 1)))


@pytest.mark.parametrize(("name", "text", "content", "calls"), EXAMPLES, ids=IDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stream_random_chunks(name, text, content, calls, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    stream(name, text, cuts)


# Fragments that, glued at random, make outputs in and around every format: well-formed, cut off, mixed.
FRAGMENTS = ["<tool_call>", "</tool_call>", "\n", " ", "Hi", W, T, '{"name": "f", ', '"arguments": ', '{"a": 1}', "}",
             "]", "[", ";", ",", "<|python_tag|>", "[TOOL_CALLS]", "get_time", "[ARGS]", "<function=f>",
             "<parameter=a>", "x", "</parameter>", "</function>", "<tool_", "</", "é"]


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "qwen3_xml"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_stream_agrees_on_glued_fragments(name, data):
    """Whatever the text, the extractor does not fail and the streamed deltas add up to its answer."""
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS), max_size=14)))
    stream(name, text, data.draw(st.lists(st.integers(0, len(text)), max_size=len(text) // 2 + 1)))


def test_streamer_ids_and_final_flush():
    parser = make("hermes")
    streamer = ToolCallStreamer(parser)
    assert streamer.update("Let me <tool_") == ("Let me ", [])
    assert streamer.update(f"Let me <tool_call>{W}") == ("", [])
    delta, deltas = streamer.update(f"Let me <tool_call>{W}", final=True)  # EOS before the close tag
    assert delta == "" and streamer.tools_called
    assert deltas == [{"index": 0, "id": parser.call_id(0), "type": "function",
                       "function": {"name": "get_weather", "arguments": ""}},
                      {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]
    assert parser.extract_tool_calls(f"Let me <tool_call>{W}").tool_calls[0].id == parser.call_id(0)


def test_unknown_parser_names_the_field():
    with pytest.raises(ValueError, match=r"^tool_call_parser: unknown parser 'nope' \(choose from .*hermes"):
        get_tool_parser("nope")
    assert {"hermes", "llama3_json", "mistral", "qwen3_xml"} <= set(TOOL_PARSERS)


def test_registering_a_parser_is_one_class():
    try:
        @register_tool_parser("test_bang")
        class BangParser(ToolParser):
            """`!name` on a line of its own is a call without arguments."""

            def scan(self, text, final):
                if not final and not text.endswith("\n"):
                    text = text[: text.rfind("\n") + 1]
                return [PartialToolCall(line[1:].strip(), "{}", True) if line.startswith("!") else line
                        for line in text.splitlines(keepends=True)]

        assert get_tool_parser("test_bang") is BangParser and BangParser.name == "test_bang"
        got = BangParser().extract_tool_calls("hi\n!ping\n")
        assert got.content == "hi\n" and [c.name for c in got.tool_calls] == ["ping"]
        assert isinstance(got, ExtractedToolCalls) and isinstance(got.tool_calls[0], ToolCall)
        stream_parser = BangParser()
        streamer = ToolCallStreamer(stream_parser)
        assert streamer.update("hi\n!pi") == ("hi\n", [])
        assert streamer.update("hi\n!ping\n", final=True)[1][0]["function"]["name"] == "ping"
    finally:
        TOOL_PARSERS.pop("test_bang", None)
