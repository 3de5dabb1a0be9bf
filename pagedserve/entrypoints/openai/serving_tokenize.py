"""POST /tokenize and POST /detokenize (vLLM's shapes): text or messages to token ids, and back."""

from __future__ import annotations

from pagedserve.entrypoints.openai.protocol import (
    DetokenizeRequest,
    OpenAIError,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from pagedserve.entrypoints.openai.serving_chat import apply_template
from pagedserve.entrypoints.openai.serving_engine import ServerContext


async def tokenize(ctx: ServerContext, body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
    ctx.check_model(body.model)
    return await ctx.in_tokenizer_thread(_tokenize, ctx, body)


def _tokenize(ctx: ServerContext, body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
    tok = ctx.tokenizer
    if isinstance(body, TokenizeChatRequest):
        text = apply_template(tok, body.messages, body.add_generation_prompt)
    else:
        text = body.prompt
    ids = tok.encode(text, add_special_tokens=body.add_special_tokens)
    return {"count": len(ids), "max_model_len": ctx.engine.max_model_len, "tokens": ids, "token_strs": None}


async def detokenize(ctx: ServerContext, body: DetokenizeRequest) -> dict:
    ctx.check_model(body.model)
    return await ctx.in_tokenizer_thread(_detokenize, ctx, body)


def _detokenize(ctx: ServerContext, body: DetokenizeRequest) -> dict:
    tok = ctx.tokenizer
    vocab = tok.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise OpenAIError(f"tokens: {bad} is not a token id in [0, {vocab})", param="tokens")
    return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}
