"""Tool-call parsers: a model's raw output -> OpenAI tool calls, for a finished output or one still streaming.

A parser is one class with one method, `scan(text, final)`, that cuts the output into pieces in order:
content strings and calls. `extract_tool_calls` (final=True) and `parse_partial` (final=False) both read
that one cut, so the streamed and the non-streamed answer cannot disagree about what the text means.

The partial scan reports only what no continuation of the text can change, because a streamed delta
cannot be taken back:
- a JSON call (hermes, llama3_json, mistral) appears once its JSON is complete and its block is closed:
  a call still being written may yet be cut off by max_tokens or turn out malformed, and then the
  finished answer has it as content;
- a qwen3_xml call appears once `<function=NAME>` is read, and its arguments grow by whole parameters
  (`{"city": "Paris"` ... `}`): that format has no JSON to break, so a header read is a call for good;
- content stops before anything undecided: an open `<tool_call>` block, or a tail such as "<tool_"
  that may become one.

Content (both modes) is the text outside the calls, in order, with malformed blocks kept as written
(a malformed call is content, not an error). A run of content between calls, before the first or after
the last, that is whitespace only is dropped: those are the newlines models put between calls, and
dropping them is what lets `content` be None for an output that is only calls.

Each parser instance serves one request: call ids are drawn once per call index, so the streamer and
the final extraction hand out the same ids.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pagedserve.entrypoints.openai.registry import Registry


def _openai_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text (OpenAI's function.arguments)
    id: str = field(default_factory=_openai_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    content: str | None  # text outside the calls; None when nothing but whitespace is left
    tool_calls: list[ToolCall]

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass
class PartialToolCall:
    name: str | None  # None until the whole name is known (the parsers here only report named calls)
    arguments: str  # a prefix of the final arguments text; only grows from one parse to the next
    complete: bool


@dataclass
class PartialParse:
    content: str  # a prefix of the final content, safe to show now; never shrinks
    calls: list[PartialToolCall]


Piece = str | PartialToolCall


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN/Infinity: Python reads them, clients' JSON parsers do not


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
_WS = re.compile(r"\s*")


def _skip_ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def _decode(text: str, start: int) -> tuple[Any, int] | None:
    """The JSON value that starts at text[start] and the index after it; None if there is none (yet)."""
    try:
        return _DECODER.raw_decode(text, start)
    except (ValueError, RecursionError):
        return None


def _hold_back(text: str, marker: str) -> str:
    """text without a tail that may still grow into `marker` ("Hi <tool_" -> "Hi ")."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k]
    return text


def _member_spans(text: str, start: int) -> dict[str, tuple[int, int]]:
    """Where each member's value lies in the valid JSON object at text[start] (a repeated key: the last)."""
    spans: dict[str, tuple[int, int]] = {}
    i = _skip_ws(text, start + 1)
    while text[i] != "}":
        key, i = _DECODER.raw_decode(text, i)
        i = _skip_ws(text, _skip_ws(text, i) + 1)  # past the ':'
        _, end = _DECODER.raw_decode(text, i)
        spans[key] = (i, end)
        i = _skip_ws(text, end)
        if text[i] == ",":
            i = _skip_ws(text, i + 1)
    return spans


def _element_starts(text: str, start: int) -> list[int]:
    """Where each element starts in the valid JSON array at text[start]."""
    starts = []
    i = _skip_ws(text, start + 1)
    while text[i] != "]":
        starts.append(i)
        _, i = _DECODER.raw_decode(text, i)
        i = _skip_ws(text, i)
        if text[i] == ",":
            i = _skip_ws(text, i + 1)
    return starts


def _call_from(obj: Any, text: str, at: int) -> PartialToolCall | None:
    """{"name": ..., "arguments"|"parameters": {...}} decoded from text[at]; the arguments keep the model's
    own JSON text. No arguments member is a call without arguments ("{}"); arguments that are not an
    object make the whole thing not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"].strip():
        return None
    key = "arguments" if "arguments" in obj else "parameters" if "parameters" in obj else None
    if key is None:
        return PartialToolCall(obj["name"], "{}", True)
    if not isinstance(obj[key], dict):
        return None
    a, b = _member_spans(text, at)[key]
    return PartialToolCall(obj["name"], text[a:b], True)


def _json_calls(text: str, start: int, allow_list: bool = True) -> tuple[list[PartialToolCall] | None, int] | None:
    """The call object (or, with allow_list, non-empty list of call objects) at text[start]: None when no
    complete JSON value is there (yet); (None, end) for a JSON value that is not calls; (calls, end)."""
    decoded = _decode(text, start)
    if decoded is None:
        return None
    value, end = decoded
    if isinstance(value, dict):
        objects = [(value, start)]
    elif allow_list and isinstance(value, list) and value:
        objects = list(zip(value, _element_starts(text, start), strict=True))
    else:
        return None, end
    calls = [_call_from(obj, text, at) for obj, at in objects]
    if any(c is None for c in calls):
        return None, end
    return calls, end


def _block_end(text: str, start: int, open_tag: str, close_tag: str) -> tuple[int, int] | None:
    """(end of body, index after the block) for a block whose body starts at `start`: it ends at its
    close tag or, when the model forgot that, at the next open tag. None: still open."""
    close, reopen = text.find(close_tag, start), text.find(open_tag, start)
    if close >= 0 and (reopen < 0 or close < reopen):
        return close, close + len(close_tag)
    if reopen >= 0:
        return reopen, reopen
    return None


def _assemble(pieces: list[Piece]) -> tuple[str, list[PartialToolCall]]:
    """Content and calls from the pieces, dropping whitespace-only runs of content (see the module doc)."""
    content: list[str] = []
    run: list[str] = []
    calls: list[PartialToolCall] = []

    def flush() -> None:
        text = "".join(run)
        run.clear()
        if text.strip():
            content.append(text)

    for piece in pieces:
        if isinstance(piece, str):
            run.append(piece)
        else:
            flush()
            calls.append(piece)
    flush()
    return "".join(content), calls


class ToolParser:
    """Base class: subclasses set nothing but `scan` (and `_new_id` for another id format)."""

    name: ClassVar[str] = ""

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = list(tools or [])
        self._ids: list[str] = []
        self._properties: dict[str, dict] = {}  # tool name -> its parameters' "properties" schema
        for tool in self.tools:
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                params = function.get("parameters")
                props = params.get("properties") if isinstance(params, dict) else None
                self._properties[function["name"]] = props if isinstance(props, dict) else {}

    def scan(self, text: str, final: bool) -> list[Piece]:
        """The output cut into content strings and calls, in order. final=False: the text may still grow,
        so report only what no continuation can change (see the module doc); final=True: the whole output."""
        raise NotImplementedError

    def call_id(self, index: int) -> str:
        """The id of the index-th call: drawn once, the same for streaming and the final extraction."""
        while len(self._ids) <= index:
            self._ids.append(self._new_id())
        return self._ids[index]

    def _new_id(self) -> str:
        return _openai_call_id()

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        content, calls = _assemble(self.scan(text, final=True))
        return ExtractedToolCalls(content or None,
                                  [ToolCall(c.name or "", c.arguments, self.call_id(i)) for i, c in enumerate(calls)])

    def parse_partial(self, text: str) -> PartialParse:
        content, calls = _assemble(self.scan(text, final=False))
        return PartialParse(content, calls)


TOOL_PARSERS: Registry[type[ToolParser]] = Registry("tool_call_parser")
register_tool_parser = TOOL_PARSERS.register  # class decorator: @register_tool_parser("name")
get_tool_parser = TOOL_PARSERS.get_class


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of times (Hermes, Qwen2.5/3),
    or a JSON list of such objects in one tag (SmolLM2). "parameters" is taken for "arguments". A block
    also ends at the next `<tool_call>` (a forgotten close tag), and a last block left open counts when
    its JSON is complete (the model may stop at EOS before the close tag). A block whose body is not
    exactly that JSON is kept, tags and all, as content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        pos = 0
        while (start := text.find(self.OPEN, pos)) >= 0:
            pieces.append(text[pos:start])
            body_start = start + len(self.OPEN)
            bounds = _block_end(text, body_start, self.OPEN, self.CLOSE)
            if bounds is None and not final:
                return pieces  # an open block is undecided: held back
            # A last block left open may end in a cut-off close tag ("...}</tool_"): not part of the JSON.
            body_end, pos = bounds or (len(text), len(text))
            body = text[body_start:body_end]
            calls = self._calls(body if bounds else _hold_back(body, self.CLOSE))
            if calls:
                pieces.extend(calls)
            else:
                pieces.append(text[start:pos])
        tail = text[pos:]
        pieces.append(tail if final else _hold_back(tail, self.OPEN))
        return pieces

    @staticmethod
    def _calls(body: str) -> list[PartialToolCall] | None:
        body = body.strip()
        got = _json_calls(body, 0) if body else None
        return got[0] if got and got[1] == len(body) else None


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON tool calls: an output that (after whitespace and an optional `<|python_tag|>`) starts
    with `{` is one or more `{"name": ..., "parameters"|"arguments": {...}}` separated by `;`. Anything
    else is plain content. If the first object is not a call the whole output is content (a JSON answer,
    not a call); text after the last call is content."""

    TAG = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> list[Piece]:
        i = _skip_ws(text, 0)
        if text.startswith(self.TAG, i):
            i = _skip_ws(text, i + len(self.TAG))
        elif not final and self.TAG.startswith(text[i:]):
            return []  # nothing yet, or the start of the tag
        if i == len(text):
            return [text] if final else []
        if text[i] != "{":
            return [text]
        pieces: list[Piece] = []
        while True:
            got = _json_calls(text, i, allow_list=False)
            if got is None and not final:
                return pieces  # an object still being written
            calls, end = got or (None, len(text))
            if not calls:
                return pieces + [text[i:]] if pieces else [text]
            pieces.extend(calls)
            j = _skip_ws(text, end)
            if text.startswith(";", j):
                j = _skip_ws(text, j + 1)
            if j == len(text):
                return pieces
            if text[j] != "{":
                return pieces + [text[j:]]
            i = j


_ALPHANUMERIC = string.ascii_letters + string.digits
_MISTRAL_NAME = re.compile(r"([^\s{\[]+)\s*(?:\[ARGS\]\s*)?")


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    """Mistral: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` (tokenizers up to
    v7), or `[TOOL_CALLS]name{...}` / `[TOOL_CALLS]name[ARGS]{...}` repeated (v11+). Text before the
    first `[TOOL_CALLS]` is content; from a malformed one on, the rest is content. Ids are 9
    alphanumeric characters, as Mistral's chat template requires."""

    MARK = "[TOOL_CALLS]"

    def _new_id(self) -> str:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))

    def scan(self, text: str, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        pos = 0
        while (mark := text.find(self.MARK, pos)) >= 0:
            pieces.append(text[pos:mark])
            got = self._after_mark(text, _skip_ws(text, mark + len(self.MARK)))
            if got is None and not final:
                return pieces  # still being written
            calls, end = got or (None, len(text))
            if not calls:
                return pieces + [text[mark:]]
            pieces.extend(calls)
            pos = end
        tail = text[pos:]
        pieces.append(tail if final else _hold_back(tail, self.MARK))
        return pieces

    @staticmethod
    def _after_mark(text: str, i: int) -> tuple[list[PartialToolCall] | None, int] | None:
        if text.startswith(("[", "{"), i) and not text.startswith("[ARGS]", i):
            return _json_calls(text, i)
        m = _MISTRAL_NAME.match(text, i)
        if m is None:
            return None
        decoded = _decode(text, m.end())
        if decoded is None:
            return None
        if not isinstance(decoded[0], dict):
            return None, decoded[1]
        return [PartialToolCall(m.group(1), text[m.end():decoded[1]], True)], decoded[1]


_HEADER = re.compile(r"([^<>\n]*)>")  # the NAME> of <function=NAME> / <parameter=NAME>
_HEADER_SO_FAR = re.compile(r"[^<>\n]*\Z")  # a header still being written
_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


@register_tool_parser("qwen3_xml")
class Qwen3XMLToolParser(ToolParser):
    """Qwen3-Coder's XML calls: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
    </function>\\n</tool_call>`. A value loses one leading and one trailing newline; it stays a string
    unless the tool's schema gives the parameter a non-string JSON type and the value parses as JSON of
    that type. A repeated parameter keeps its first value (so streamed arguments stay a prefix). Closing
    tags may be missing: a parameter ends at the next parameter or the end of its function, a function
    at the next function or the end of its block, a block at the next block or the end of the output.
    The arguments text is json.dumps of the parameters (ensure_ascii=False). A block without a
    function is content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    FUNCTION, FUNCTION_END = "<function=", "</function>"
    PARAM, PARAM_END = "<parameter=", "</parameter>"

    def scan(self, text: str, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        pos = 0
        while (start := text.find(self.OPEN, pos)) >= 0:
            pieces.append(text[pos:start])
            body_start = start + len(self.OPEN)
            bounds = _block_end(text, body_start, self.OPEN, self.CLOSE)
            closed = bounds is not None or final
            body_end, pos = bounds or (len(text), len(text))
            body = text[body_start:body_end]
            calls = self._functions(_hold_back(body, self.CLOSE) if bounds is None else body, closed)
            if calls:
                pieces.extend(calls)
            elif closed:
                pieces.append(text[start:pos])
            if bounds is None:
                return pieces
        tail = text[pos:]
        pieces.append(tail if final else _hold_back(tail, self.OPEN))
        return pieces

    def _functions(self, body: str, closed: bool) -> list[PartialToolCall]:
        calls = []
        pos = 0
        while (at := body.find(self.FUNCTION, pos)) >= 0:
            pos = at + len(self.FUNCTION)
            header = _HEADER.match(body, pos)
            if header is None or not header.group(1).strip():
                if header is None and not closed and _HEADER_SO_FAR.match(body, pos):
                    break  # the name is still being written
                continue  # not a function header
            name, start = header.group(1).strip(), header.end()
            bounds = _block_end(body, start, self.FUNCTION, self.FUNCTION_END)
            done = bounds is not None or closed
            end, after = bounds or (len(body), len(body))
            params = self._params(name, body[start:end], done)
            arguments = json.dumps(params, ensure_ascii=False)
            calls.append(PartialToolCall(name, arguments if done else arguments[:-1], done))
            if not done:
                break
            pos = after
        return calls

    def _params(self, function: str, region: str, closed: bool) -> dict[str, Any]:
        params: dict[str, Any] = {}
        pos = 0
        while (at := region.find(self.PARAM, pos)) >= 0:
            pos = at + len(self.PARAM)
            header = _HEADER.match(region, pos)
            if header is None:
                if not closed and _HEADER_SO_FAR.match(region, pos):
                    break
                continue
            bounds = _block_end(region, header.end(), self.PARAM, self.PARAM_END)
            if bounds is None and not closed:
                break  # the value is still being written
            end, pos = bounds or (len(region), len(region))
            key, value = header.group(1).strip(), region[header.end():end]
            value = value.removeprefix("\n").removesuffix("\n")
            if key and key not in params:
                params[key] = self._convert(function, key, value)
        return params

    def _convert(self, function: str, key: str, value: str) -> Any:
        schema = self._properties.get(function, {}).get(key)
        types = schema.get("type") if isinstance(schema, dict) else None
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
        checks = [_JSON_TYPES[t] for t in types if t in _JSON_TYPES]
        if not checks or "string" in types:
            return value
        try:
            parsed = _DECODER.decode(value.strip())
        except (ValueError, RecursionError):
            return value
        return parsed if any(check(parsed) for check in checks) else value


class ToolCallStreamer:
    """Turns the growing output text into OpenAI streaming deltas.

    update(text) gets the whole output so far and returns (content delta, tool-call deltas). A call's
    first delta carries index, id, type and name with empty arguments; later ones only new argument
    characters. update(text, final=True) flushes the rest using extract_tool_calls(text) as the truth, so
    the deltas add up to exactly the non-streaming answer (same content, names, arguments and ids): the
    partial parse only ever reveals prefixes of that answer."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._content = ""  # content sent so far
        self._arguments: list[str] = []  # per call started: the arguments sent so far

    def update(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        if final:
            result = self.parser.extract_tool_calls(text)
            content, calls = result.content or "", [(c.name, c.arguments) for c in result.tool_calls]
        else:
            partial = self.parser.parse_partial(text)
            content, calls = partial.content, []
            for call in partial.calls:
                if call.name is None:
                    break  # later calls would take this one's index
                calls.append((call.name, call.arguments))
        delta = content[len(self._content):] if content.startswith(self._content) else ""
        self._content += delta
        deltas: list[dict] = []
        for index, (name, arguments) in enumerate(calls):
            if index == len(self._arguments):
                deltas.append({"index": index, "id": self.parser.call_id(index), "type": "function",
                               "function": {"name": name, "arguments": ""}})
                self._arguments.append("")
            sent = self._arguments[index]
            if len(arguments) > len(sent) and arguments.startswith(sent):
                deltas.append({"index": index, "function": {"arguments": arguments[len(sent):]}})
                self._arguments[index] = arguments
        return delta, deltas

    @property
    def tools_called(self) -> bool:
        return bool(self._arguments)
