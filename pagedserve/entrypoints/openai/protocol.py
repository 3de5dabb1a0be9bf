"""OpenAI request/response shapes (pydantic), and their mapping to SamplingParams.

Requests ignore fields they do not know (clients send `user`, `logit_bias`, ...); responses are built
as plain dicts in the serving_*.py modules with the exact shapes OpenAI's clients parse.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationInfo, field_validator

from pagedserve.sampling_params import MAX_N, SEED_MAX, SEED_MIN, SamplingParams, check_text
from pagedserve.structured_output.params import StructuredOutputsParams

# Prompts of one /v1/completions request, and sequences (prompts x n) it may start: a guard against one
# request filling the whole engine.
MAX_PROMPTS = 256
MAX_SEQUENCES_PER_REQUEST = 512
_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\[\d+\])?:")
SeedInt = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]


class OpenAIError(Exception):
    """Raised by handlers; rendered as OpenAI's error body."""

    def __init__(
        self, message: str, status_code: int = 400, type: str = "invalid_request_error",
        param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_value_error(cls, e: ValueError) -> OpenAIError:
        """SamplingParams and the engine raise "field: reason"; the field becomes `param`."""
        text = str(e)
        m = _FIELD.match(text)
        return cls(text, 400, param=m.group(1) if m else None)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        """JSON may carry lone surrogates ("\\ud800"): text that no tokenizer can take is a 400 here."""
        _check_strings(info.field_name or "body", value)
        return value


def _check_strings(name: str, value: Any) -> None:
    if isinstance(value, str):
        check_text(name, value)
    elif isinstance(value, list | tuple):
        for v in value:
            _check_strings(name, v)


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    # OpenAI's field is `schema`; pydantic reserves the name, hence the alias.
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Request):
    """Fields both endpoints share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: SeedInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, and the older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint the request asks for (a 400 naming the field when it asks for two)."""
        given: list[tuple[str, dict]] = []
        if self.response_format is not None and self.response_format.type != "text":
            rf = self.response_format
            if rf.type == "json_object":
                given.append(("response_format", {"json_object": True}))
            else:
                if rf.json_schema is None or rf.json_schema.json_schema is None:
                    raise OpenAIError("response_format: type json_schema needs json_schema.schema",
                                      param="response_format")
                given.append(("response_format", {"json": rf.json_schema.json_schema}))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", dict(self.structured_outputs)))
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        for kind, value in guided.items():
            if value is not None:
                given.append((f"guided_{kind}", {kind: value}))
        if self.guided_decoding_backend not in (None, "auto", "guidance", "llguidance"):
            raise OpenAIError(f"guided_decoding_backend: {self.guided_decoding_backend!r} is not available "
                              "(this server has llguidance: 'guidance')", param="guided_decoding_backend")
        if not given:
            return None
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise OpenAIError(f"{given[0][0]}: give one structured-output constraint, got {names}",
                              param=given[0][0])
        name, spec = given[0]
        if self.guided_whitespace_pattern is not None:
            spec.setdefault("whitespace_pattern", self.guided_whitespace_pattern)
        try:
            return StructuredOutputsParams.from_dict(spec, source=name)
        except (ValueError, TypeError) as e:
            raise OpenAIError(f"{name}: {e}".replace(f"{name}: structured_outputs: ", f"{name}: "),
                              param=name) from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if not 1 <= self.n <= MAX_N:
            raise OpenAIError(f"n: must be an integer in [1, {MAX_N}], got {self.n}", param="n")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options: only allowed when stream is true", param="stream_options")
        values: dict[str, Any] = dict(
            n=self.n, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )
        optional = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                        repetition_penalty=self.repetition_penalty)
        values.update({k: v for k, v in optional.items() if v is not None})
        values["structured_outputs"] = self.structured_outputs_params()
        try:
            return SamplingParams(**values)
        except ValueError as e:
            raise OpenAIError.from_value_error(e) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


PromptField = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(_SamplingFields):
    prompt: PromptField
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(_Request):
    name: StrictStr
    arguments: StrictStr = "{}"


class MessageToolCall(_Request):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a role "tool" message: the call it answers
    reasoning_content: str | None = None  # sent back by clients; not shown to the template

    def as_template_dict(self) -> dict:
        """The message as chat templates read it: tool-call arguments as objects (templates render them
        with `tojson`), as vLLM hands them over."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        d: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                               for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class FunctionDefinition(_Request):
    name: StrictStr
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not TOOL_NAME.match(v):
            raise ValueError("a function name is 1-64 characters of a-z, A-Z, 0-9, _, . and -")
        return v


class ToolDefinition(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: StrictStr


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: StrictStr
    add_special_tokens: bool = True


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[StrictInt]
