"""Tools and reasoning on /v1/chat/completions: what a request's `tools` / `tool_choice` ask of generation,
and how an output's text becomes an assistant message (content, tool_calls, reasoning_content).

tool_choice (OpenAI's, as vLLM serves it):
- `none` (the default without tools): tools go to the template, the output is plain content.
- `auto` (the default with tools): the server's `--tool-call-parser` finds calls in the output; it needs
  `--enable-auto-tool-choice`, as in vLLM. finish_reason "tool_calls" when the model called one.
- `required`: generation follows a JSON schema built from the tools (a non-empty list of
  {"name", "arguments"}, each tool's arguments under its own parameters schema), so the call always
  parses. finish_reason "tool_calls".
- a named function: generation follows that function's parameters schema; the output is its arguments.
  finish_reason "stop", as OpenAI answers a forced function.
`parallel_tool_calls: false` keeps one call (`required`: the schema allows one).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, NamedToolChoice, OpenAIError
from pagedserve.entrypoints.openai.reasoning_parsers import ReasoningParser, ReasoningStreamer
from pagedserve.entrypoints.openai.tool_parsers import (
    PartialToolCall,
    ToolCall,
    ToolCallStreamer,
    ToolParser,
    get_tool_parser,
)
from pagedserve.structured_output.params import StructuredOutputsParams

OPEN_OBJECT = {"type": "object"}


@dataclass
class ToolOptions:
    """The server's flags (vLLM's names): --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        from pagedserve.entrypoints.openai.reasoning_parsers import get_reasoning_parser

        self.parser_cls = get_tool_parser(self.tool_call_parser) if self.tool_call_parser else None
        self.reasoning_cls = get_reasoning_parser(self.reasoning_parser) if self.reasoning_parser else None
        if self.enable_auto_tool_choice and self.parser_cls is None:
            raise ValueError("enable_auto_tool_choice: needs --tool-call-parser")


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """A JSON list of one or more calls, each {"name": one of the tools, "arguments": its parameters}."""
    calls = [{
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                       "arguments": t["function"].get("parameters") or OPEN_OBJECT},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for t in tools]
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class RequiredCallsParser(ToolParser):
    """The output of tool_choice "required": the JSON list `required_schema` makes the model write, with
    "name" before "arguments" in every call. The grammar guarantees the shape, so a call is reported as
    soon as its name is complete and its arguments grow character by character (each a prefix of the raw
    arguments text the model writes). A list cut off by max_tokens keeps its last call, incomplete."""

    HEAD = re.compile(r'\s*[\[,]\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
    CLOSE = re.compile(r"\s*\}")

    def scan(self, text: str, final: bool) -> list:
        calls: list = []
        pos, decoder = 0, json.JSONDecoder()
        while (head := self.HEAD.match(text, pos)) is not None:
            name = json.loads(f'"{head.group(1)}"')
            start = head.end()
            try:
                _, end = decoder.raw_decode(text, start)
            except ValueError:
                calls.append(PartialToolCall(name, text[start:], False))
                break
            calls.append(PartialToolCall(name, text[start:end], True))
            close = self.CLOSE.match(text, end)
            if close is None:
                break
            pos = close.end()
        return calls


@dataclass
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict] = field(default_factory=list)  # OpenAI's shape, for the template and the parsers
    function: str | None = None  # the named function
    parallel: bool = True
    parser_cls: type[ToolParser] | None = None
    reasoning_cls: type[ReasoningParser] | None = None

    @classmethod
    def from_request(cls, body: ChatCompletionRequest, options: ToolOptions) -> ToolPlan:
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        choice = body.tool_choice
        if choice is None:
            choice = "auto" if tools else "none"
        plan = cls("none", tools, parallel=body.parallel_tool_calls, reasoning_cls=options.reasoning_cls)
        if choice == "none":
            return plan
        if not tools:
            raise OpenAIError("tool_choice: only allowed when tools are given", param="tool_choice")
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise OpenAIError("tools: function names must be unique", param="tools")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise OpenAIError(f"tool_choice: function {choice.function.name!r} is not among the tools",
                                  param="tool_choice")
            plan.mode, plan.function = "named", choice.function.name
        elif choice == "required":
            plan.mode = "required"
        else:
            if not (options.enable_auto_tool_choice and options.parser_cls is not None):
                raise OpenAIError('tool_choice: "auto" needs the server started with --enable-auto-tool-choice '
                                  "and --tool-call-parser", param="tool_choice")
            plan.mode, plan.parser_cls = "auto", options.parser_cls
        return plan

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar `required` and a named function put on generation (None for none / auto)."""
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(self.tools, self.parallel), source="tools")
        if self.mode == "named":
            tool = next(t for t in self.tools if t["function"]["name"] == self.function)
            return StructuredOutputsParams(json=tool["function"].get("parameters") or OPEN_OBJECT, source="tools")
        return None

    def _call_parser(self) -> ToolParser | None:
        if self.mode == "auto":
            return self.parser_cls(self.tools)
        if self.mode == "required":
            return RequiredCallsParser(self.tools)
        return None

    # ---- a finished output -----------------------------------------------------------------------------
    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(the assistant message, the choice's finish_reason)."""
        reasoning, content = None, text
        if self.reasoning_cls is not None:
            reasoning, content = self.reasoning_cls().extract_reasoning(text)
        msg: dict = {"role": "assistant", "content": content}
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        calls = self._calls(content or "")
        if calls is not None:
            msg["content"], calls_list = calls
            msg["tool_calls"] = [c.to_openai() for c in calls_list]
            if calls_list and self.mode in ("auto", "required") and finish_reason == "stop":
                finish_reason = "tool_calls"
        return msg, finish_reason

    def _calls(self, content: str) -> tuple[str | None, list[ToolCall]] | None:
        if self.mode == "named":
            return None, [ToolCall(name=self.function, arguments=content.strip(), id=call_id())]
        parser = self._call_parser()
        if parser is None:
            return None
        found = parser.extract_tool_calls(content)
        calls = found.tool_calls if self.parallel else found.tool_calls[:1]
        if self.mode == "required" and not calls:  # cut off before the list closed: show what there is
            return content or None, []
        return found.content if self.mode == "auto" else None, calls

    def streamer(self) -> ChoiceStreamer:
        return ChoiceStreamer(self)


class ChoiceStreamer:
    """One choice's stream: the whole text so far in, the delta to send out (reasoning_content, content,
    tool_calls), so that the deltas add up to exactly what the non-streaming message holds."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.reasoning = ReasoningStreamer(plan.reasoning_cls()) if plan.reasoning_cls is not None else None
        parser = plan._call_parser()
        self.calls = ToolCallStreamer(parser) if parser is not None else None
        self.content = ""  # the content part so far (after the reasoning)
        self.content_sent = 0
        self.named_started = False
        self.named_sent = 0
        self.called = False

    def update(self, text: str, final: bool) -> dict:
        """text: the choice's whole output so far; final: it has finished (flush everything)."""
        delta: dict = {}
        if self.reasoning is not None:
            reasoning_delta, content_delta = self.reasoning.update(text, final)
            if reasoning_delta:
                delta["reasoning_content"] = reasoning_delta
            self.content += content_delta
        else:
            self.content = text
        plan = self.plan
        if plan.mode == "named":
            self._named(delta, final)
        elif self.calls is not None:
            content_delta, call_deltas = self.calls.update(self.content, final)
            if not plan.parallel:
                call_deltas = [d for d in call_deltas if d["index"] == 0]
            if call_deltas:
                delta["tool_calls"] = call_deltas
            self.called = self.calls.tools_called
            if plan.mode == "auto" and content_delta:
                delta["content"] = content_delta
            elif plan.mode == "required" and final and not self.called and self.content:
                delta["content"] = self.content  # cut off before the list closed, as the message shows it
        elif len(self.content) > self.content_sent:
            delta["content"] = self.content[self.content_sent:]
            self.content_sent = len(self.content)
        return delta

    def _named(self, delta: dict, final: bool) -> None:
        """A named function: the output is its arguments, streamed as they grow."""
        args = self.content.strip() if final else self.content.lstrip()
        call: dict = {"index": 0, "function": {"arguments": ""}}
        if not self.named_started and (args or final):
            self.named_started = True
            call.update(id=call_id(), type="function")
            call["function"]["name"] = self.plan.function
        if len(args) > self.named_sent:
            call["function"]["arguments"] = args[self.named_sent:]
            self.named_sent = len(args)
        if "id" in call or call["function"]["arguments"]:
            delta["tool_calls"] = [call]
        self.called = True

    def finish_reason(self, reason: str | None) -> str | None:
        if reason == "stop" and self.called and self.plan.mode in ("auto", "required"):
            return "tool_calls"
        return reason
