"""Tokenizer front: HF tokenizer + chat template, and incremental detokenizing.

The incremental detokenizer uses tokenizers' DecodeStream (it handles UTF-8 split over tokens and
byte-fallback) seeded with the end of the prompt so the first word keeps its leading space. Stop strings
and the text held back from streams are decided in engine/stop.py.
"""

from __future__ import annotations

from importlib.resources import files

from tokenizers.decoders import DecodeStream

from pagedserve.model.loader import load_hf_tokenizer

# Chat templates pagedserve supplies when a model's files carry none (GGUF conversions often drop it),
# by architecture (model/config.py's names), and the token that ends such a model's turn (a stop token).
SUPPLIED_CHAT_TEMPLATES = {"gemma2": "gemma.jinja", "gemma3": "gemma.jinja"}
TURN_END_TOKENS = {"gemma2": "<end_of_turn>", "gemma3": "<end_of_turn>"}
# For conversations with tools when the model's own template knows none: ChatML templates get this one.
TOOLS_CHAT_TEMPLATE = "chatml_tools.jinja"


def _template(name: str) -> str:
    return files("pagedserve.chat_templates").joinpath(name).read_text()


def supplied_chat_template(architecture: str | None) -> str | None:
    name = SUPPLIED_CHAT_TEMPLATES.get(architecture or "")
    return None if name is None else _template(name)


def uses_tools(messages: list[dict], tools: list[dict] | None) -> bool:
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


class Tokenizer:
    def __init__(self, path: str, architecture: str | None = None) -> None:
        """architecture: the model's (ModelConfig.architecture), for the chat template and turn-end token
        pagedserve supplies when the files have none."""
        self.hf = load_hf_tokenizer(path)
        self.backend = self.hf.backend_tokenizer if hasattr(self.hf, "backend_tokenizer") else self.hf._tokenizer
        self.chat_template_supplied = False
        if not getattr(self.hf, "chat_template", None):
            template = supplied_chat_template(architecture)
            if template is not None:
                self.hf.chat_template = template
                self.chat_template_supplied = True
        # Chat models end a turn with their own token (Gemma's <end_of_turn>), which is an EOS for them.
        self.turn_end_token_ids: list[int] = []
        piece = TURN_END_TOKENS.get(architecture or "")
        if piece is not None:
            tid = self.hf.convert_tokens_to_ids(piece)
            if isinstance(tid, int) and tid != self.hf.unk_token_id:
                self.turn_end_token_ids.append(tid)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        return self.hf.decode([token_id], skip_special_tokens=False)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def tools_template(self) -> str | None:
        """The template for a conversation with tools: the model's own if it reads `tools`, the supplied
        ChatML one for ChatML models without, else None (this model cannot take tools)."""
        own = getattr(self.hf, "chat_template", None) or ""
        if not isinstance(own, str):
            return None
        if "tools" in own:
            return own
        if "<|im_start|>" in own:
            return _template(TOOLS_CHAT_TEMPLATE)
        return None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """tools: OpenAI's tool definitions (rendered by a tool-aware template, see tools_template)."""
        if not messages:
            raise ValueError("messages: must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}]: each message needs a 'role' and a 'content'")
        if not self.has_chat_template:
            raise ValueError("messages: this model has no chat template; use a plain prompt")
        if uses_tools(messages, tools):
            template = self.tools_template()
            if template is None:
                raise ValueError("tools: this model's chat template does not support tools")
            return self.hf.apply_chat_template(messages, tools=tools or None, chat_template=template, tokenize=False,
                                               add_generation_prompt=add_generation_prompt)
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


class IncrementalDetokenizer:
    """Turns one sequence's new tokens into text, piece by piece (stop strings: engine/stop.py)."""

    CONTEXT_TOKENS = 6

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        context = list(prompt_token_ids[-self.CONTEXT_TOKENS :])
        # A prompt that ends inside a UTF-8 character (token-id prompts can) would make the stream's first
        # piece repeat the context's text: the context stops before such a tail.
        while context and tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            context.pop()
        self.stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def decode(self, token_id: int) -> str:
        """The text this token adds ("" while a UTF-8 character is still incomplete)."""
        return self.stream.step(self.tokenizer.backend, token_id) or ""
