"""The offline API, as vLLM's: LLM(...).generate(prompts, sampling_params) and LLM.chat(messages)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from pagedserve.config import EngineConfig
from pagedserve.engine.engine import LLMEngine, Prompt
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

# num_scheduler_steps of LLM.generate / chat when the caller leaves it unset: they return whole outputs, so decode
# steps may run in runs of 8 (EngineConfig.num_scheduler_steps).
OFFLINE_SCHEDULER_STEPS = 8


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        """model: a HF model directory, a .gguf file, a Hugging Face hub id `org/name` (or `org/name:QUANT`, one
        GGUF of a GGUF repo; `revision=` picks a branch, tag or commit), or None for the bundled model;
        kwargs: any other EngineConfig field."""
        unknown = set(kwargs) - set(EngineConfig.field_names())
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: unknown engine argument")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        # generate / chat return whole outputs: no stream to keep token by token (the engine itself, when a caller
        # steps it, keeps the configured value: 1 unless set)
        self._num_scheduler_steps = kwargs.get("num_scheduler_steps") or OFFLINE_SCHEDULER_STEPS
        self._ids = itertools.count()

    @property
    def num_scheduler_steps(self) -> int:
        """The decode steps generate / chat run in a row (EngineConfig.num_scheduler_steps; unset: 8)."""
        return self._num_scheduler_steps

    def get_tokenizer(self):
        return self.engine.tokenizer.hf

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params: got {len(params)} for {len(prompts)} prompts (give one or one per prompt)"
                )
        # Grammars compile here, before anything is added: an invalid schema is a ValueError, as in vLLM.
        for p in params:
            if isinstance(p, SamplingParams) and p.structured_outputs is not None:
                self.engine.structured.compile(p.structured_outputs)
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """tools: OpenAI-shaped tool definitions for the chat template (the output is not parsed here)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [
            {"prompt_token_ids": tok.encode(tok.apply_chat_template(c, add_generation_prompt, tools), False)}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start, out_tokens = time.time(), 0
        configured, self.engine.num_scheduler_steps = self.engine.num_scheduler_steps, self._num_scheduler_steps
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        out_tokens += sum(len(o.token_ids) for o in out.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"output {out_tokens / max(time.time() - start, 1e-9):.1f} tok/s")
        except BaseException:
            self.engine.abort_request(ids)
            raise
        finally:
            self.engine.num_scheduler_steps = configured
            bar.close()
        return [results[i] for i in ids]
