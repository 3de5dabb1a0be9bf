"""`pagedserve generate --explain "prompt"`: the journey of one prompt through the engine, in the terminal.

Shows the prompt's token ids and text pieces, then every engine step: what the scheduler decided
(a prefill chunk of N tokens or one decode token), the KV blocks allocated and the block table
(logical token range → physical block), the top-5 candidates with their probabilities and the token
chosen, and finally why generation stopped. With speculative decoding (--speculative-config) a decode
step also scores draft tokens: it shows what was proposed, how many the model accepted, the token it
chose at the first rejected position (or the bonus token), and a candidates table for every token the
step added. Everything comes from the real run: the engine's
StepRecords (with keep_block_tables) and the sampler's logprobs.
"""

from __future__ import annotations

import argparse
import math

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from pagedserve.config import EngineConfig
from pagedserve.core.kv_math import blocks_for_tokens
from pagedserve.engine.engine import LLMEngine
from pagedserve.entrypoints.cli.generate import build_prompt, sampling_from_args
from pagedserve.outputs import RequestOutput

REQUEST_ID = "explain"
TOP_K = 5
MAX_TOKENS_SHOWN = 200  # prompt tokens listed one by one; longer prompts show their head and tail


def piece(text: str | None) -> str:
    """A token's text, visible: quotes, and escapes for whitespace and control characters."""
    return repr(text if text is not None else "")


def block_ranges(table: list[int], num_tokens: int | None, block_size: int) -> list[str]:
    """'0–15 → block 7' for each block of a block table, the last one cut at the tokens written."""
    out = []
    for j, block in enumerate(table):
        start, end = j * block_size, (j + 1) * block_size - 1
        if num_tokens is not None:
            if num_tokens <= start:
                out.append(f"(empty) → block {block}")
                continue
            end = min(end, num_tokens - 1)
        out.append(f"tokens {start}–{end} → block {block}")
    return out


def run_explain(args: argparse.Namespace, config: EngineConfig) -> int:
    if len(args.prompts) != 1:
        raise ValueError(f"explain: give exactly one prompt, got {len(args.prompts)}")
    console = Console(highlight=False)
    engine = LLMEngine(config)
    tok = engine.tokenizer
    prompt = build_prompt(engine, args.prompts[0], args.raw)
    params = sampling_from_args(args, engine).clone(logprobs=TOP_K)
    engine.add_request(REQUEST_ID, prompt, params)
    ids = prompt["prompt_token_ids"]
    bs = engine.config.block_size
    max_tokens = engine.get_request(REQUEST_ID).max_tokens

    console.rule("[bold]1. Tokenize")
    console.print(f"Prompt: {len(ids)} tokens" + ("" if args.raw or not tok.has_chat_template
                                                   else " (after the chat template)"))
    console.print(_token_table(engine, ids))

    console.rule("[bold]2. KV cache")
    console.print(
        f"block_size {bs} tokens; {engine.stats().num_kv_blocks} blocks of "
        f"{engine.block_bytes} bytes each in the pool; this prompt needs "
        f"{blocks_for_tokens(len(ids), bs)} blocks, at most {blocks_for_tokens(len(ids) + max_tokens, bs)} "
        f"with max_tokens {max_tokens}."
    )

    console.rule("[bold]3. Steps (schedule → model → sample)")
    if engine.speculative_config is not None:
        sc = engine.speculative_config
        console.print(f"Speculative decoding: {sc.method}, up to {sc.num_speculative_tokens} draft tokens a step, "
                      "checked by the model in the same forward pass")
    final: RequestOutput | None = None
    table: list[int] = []
    shown_tokens = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        rec = engine.step_records[-1]
        n = rec.scheduled.get(REQUEST_ID, 0)
        out = next((o for o in outputs if o.request_id == REQUEST_ID), None)
        if out is not None:
            final = out
        if not n:
            console.print(f"step {rec.step}: not scheduled (waiting for blocks or budget)")
            continue
        drafts = rec.spec_drafts.get(REQUEST_ID, [])
        accepted = min(rec.spec_accepted.get(REQUEST_ID, 0), len(drafts))
        new_table = (rec.block_tables or {}).get(REQUEST_ID, table)
        added = [b for b in new_table if b not in table]
        computed = _computed_after(engine, out, n)
        kind = "prefill" if REQUEST_ID in rec.prefill_requests else "decode"
        # The positions scored: the tokens kept end at `computed`, rejected drafts were scored after them.
        start = computed - (n - len(drafts) + accepted) if computed is not None else None
        where = f" (positions {start}–{start + n - 1})" if start is not None and n > 1 else (
            f" (position {start})" if start is not None else "")
        if drafts:
            real = n - len(drafts)
            what = (f"{real} token{'s' if real != 1 else ''} + {len(drafts)} draft token"
                    f"{'s' if len(drafts) != 1 else ''} ({accepted} accepted)")
        else:
            what = f"{n} token{'s' if n != 1 else ''}"
        line = f"[bold]step {rec.step}[/bold]: {kind} {what}{where}"
        if rec.prefix_cache_queries:
            line += f"; prefix cache: {rec.prefix_cache_hits} of {rec.prefix_cache_queries} tokens hit"
        console.print(line)
        # Lookahead blocks taken for draft slots that were rejected go back to the pool after the step.
        keep = blocks_for_tokens(computed, bs) if computed is not None else len(new_table)
        table, returned = new_table[:keep], new_table[keep:]
        if added:
            console.print(f"  blocks allocated: {added}  (pool: {rec.num_used_blocks} used, "
                          f"{rec.num_free_blocks + rec.num_cached_free_blocks} free)")
        console.print("  block table: " + ", ".join(block_ranges(table, computed, bs)))
        if returned and drafts:
            console.print(f"  draft lookahead blocks returned to the pool: {returned}")
        comp = out.outputs[0] if out is not None and out.outputs else None
        if drafts:
            _print_drafts(console, tok, drafts, accepted, comp.token_ids[shown_tokens:] if comp else [])
        lps = comp.logprobs if comp is not None else None
        if lps and len(lps) > shown_tokens:
            # One token a step, or with drafts the accepted ones and the model's own next one.
            for j in range(shown_tokens, len(lps)):
                i = j - shown_tokens
                role = ("accepted draft" if i < accepted else "bonus token" if i == len(drafts)
                        else "instead of the rejected draft") if drafts else None
                console.print(_candidates_table(lps[j], comp.token_ids[j], j + 1, role))
            shown_tokens = len(lps)
        elif kind == "prefill":
            console.print("  (prefill chunk ends before the prompt does: no token sampled yet)")

    console.rule("[bold]4. Result")
    if final is None:
        console.print("no output")
        return 1
    comp = final.outputs[0]
    console.print(f"Generated {len(comp.token_ids)} tokens: {comp.text!r}")
    total = len(final.prompt_token_ids) + len(comp.token_ids)
    console.print(f"Final block table: K/V of {total - 1} tokens in {len(table)} blocks (the last sampled "
                  "token is never fed back); freed when the request finished:")
    for r in block_ranges(table, total - 1, bs):
        console.print(f"  {r}")
    console.print(f"Stop reason: {_stop_reason(engine, final, max_tokens)}")
    spec = engine.stats().spec_decode
    if spec is not None:
        rate = f" ({spec.num_accepted_tokens / spec.num_draft_tokens:.0%})" if spec.num_draft_tokens else ""
        console.print(f"Speculation: {spec.num_drafts} proposals, {spec.num_draft_tokens} draft tokens, "
                      f"{spec.num_accepted_tokens} accepted{rate}; accepted per draft position: "
                      f"{spec.accepted_per_pos}")
    return 0


def _print_drafts(console: Console, tok, drafts: list[int], accepted: int, new_tokens: list[int]) -> None:
    """What was proposed and what the model kept: the accepted prefix, then its own token at the first
    rejected position (or, with every draft accepted, the bonus token after them)."""
    shown = ", ".join(f"{t} {piece(tok.id_to_piece(t))}" for t in drafts)
    console.print(f"  proposed {len(drafts)} draft token{'s' if len(drafts) != 1 else ''}: {shown}")
    kept = f"  kept {accepted} of {len(drafts)}"
    nxt = new_tokens[accepted] if len(new_tokens) > accepted else None
    nxt_text = f"{nxt} {piece(tok.id_to_piece(nxt))}" if nxt is not None else None
    if accepted == len(drafts):
        kept += f": all accepted, then the bonus token {nxt_text}" if nxt_text else ": all accepted"
    else:
        rejected = drafts[accepted]
        kept += (f"; draft {accepted + 1} ({rejected} {piece(tok.id_to_piece(rejected))}) rejected"
                 + (f": the model chose {nxt_text} instead" if nxt_text else ""))
        if accepted + 1 < len(drafts):
            kept += f", the {len(drafts) - accepted - 1} after it dropped"
    console.print(kept)


def _computed_after(engine: LLMEngine, out: RequestOutput | None, n: int) -> int | None:
    req = engine.get_request(REQUEST_ID)
    if req is not None:
        return req.num_computed_tokens
    if out is not None and out.outputs:  # finished: everything but the last sampled token was computed
        return len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
    return None


def _token_table(engine: LLMEngine, ids: list[int]) -> Table:
    t = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    t.add_column("pos", justify="right")
    t.add_column("id", justify="right")
    t.add_column("piece")
    t.add_column("logical block", justify="right")
    bs = engine.config.block_size
    shown = range(len(ids))
    if len(ids) > MAX_TOKENS_SHOWN:
        head = MAX_TOKENS_SHOWN * 3 // 4
        shown = list(range(head)) + [-1] + list(range(len(ids) - (MAX_TOKENS_SHOWN - head), len(ids)))
    for i in shown:
        if i < 0:
            t.add_row("…", "", f"({len(ids) - MAX_TOKENS_SHOWN} more)", "")
            continue
        t.add_row(str(i), str(ids[i]), piece(engine.tokenizer.id_to_piece(ids[i])), str(i // bs))
    return t


def _candidates_table(entry: dict, chosen: int, index: int, role: str | None = None) -> Group:
    # The title is a line of its own: a table's title wraps at the table's width.
    title = Text(f"  token {index}: top-{TOP_K} candidates" + (f" ({role})" if role else ""), style="italic")
    t = Table(box=None, header_style="bold", pad_edge=False)
    t.add_column("rank", justify="right")
    t.add_column("id", justify="right")
    t.add_column("piece")
    t.add_column("prob", justify="right")
    t.add_column("logprob", justify="right")
    t.add_column("")
    ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30))
    for tid, lp in ranked:
        mark = "← chosen" if tid == chosen else ""
        t.add_row(str(lp.rank), str(tid), piece(lp.decoded_token), f"{math.exp(lp.logprob):.4f}",
                  f"{lp.logprob:.3f}", mark)
    return Group(title, t)


def _stop_reason(engine: LLMEngine, out: RequestOutput, max_tokens: int) -> str:
    comp = out.outputs[0]
    reason = comp.finish_reason
    if reason == "length":
        if len(comp.token_ids) >= max_tokens:
            return f"length (max_tokens={max_tokens} reached)"
        return f"length (max_model_len={engine.max_model_len} reached)"
    if reason == "stop":
        if isinstance(comp.stop_reason, str):
            return f"stop (stop string {comp.stop_reason!r})"
        if isinstance(comp.stop_reason, int):
            return f"stop (stop token id {comp.stop_reason})"
        last = comp.token_ids[-1] if comp.token_ids else None
        if last is not None and last in engine.eos_token_ids:
            return f"stop (end-of-sequence token {last} {piece(engine.tokenizer.id_to_piece(last))})"
        return "stop"
    return str(reason)
