"""LLMEngine: schedule → run the model → sample → update, one step at a time.

Requests join and leave the batch between steps (continuous batching). Every step appends a
StepRecord; every request that advanced gets a RequestOutput. Everything outside the engine reads it
through `stats()`, `get_request()`, `live_requests()` and `step_records`, and changes it through
`add_request`, `abort_request`, `abort_all` and `reset_prefix_cache`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from pagedserve.config import EngineConfig, default_kv_cache_bytes, usable_cores
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_math import bytes_per_block, capacity, human_bytes
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedserve.engine.output_processor import OutputProcessor, ParentState
from pagedserve.engine.stats import EngineStats, RequestInfo
from pagedserve.engine.trace import StepRecord
from pagedserve.executor import UniProcExecutor
from pagedserve.executor.multiproc import MultiprocExecutor, load_rank, start_group
from pagedserve.executor.tensor_parallel import plan as tp_plan
from pagedserve.kernels import CpuKernels
from pagedserve.model.loader import load_model, resolve_dtype
from pagedserve.outputs import RequestMetrics, RequestOutput
from pagedserve.sampling.metadata import RequestGenerators, SamplingMetadata, has_penalty
from pagedserve.sampling.rejection_sampler import VerifyOutput
from pagedserve.sampling.sampler import StepsOutput
from pagedserve.sampling_params import SamplingParams, check_text
from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.spec_decode.speculator import Speculator
from pagedserve.structured_output.manager import StructuredOutputManager
from pagedserve.tokenizer import Tokenizer
from pagedserve.worker.kv_cache import allocate_kv_cache
from pagedserve.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedserve")

Prompt = str | list[int] | dict


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.data_parallel_size > 1:
            raise ValueError("data_parallel_size: replicas are separate engine processes behind `pagedserve serve "
                             "--data-parallel-size N`; one LLMEngine is one replica (data_parallel_size=1)")
        if config.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: 'cuda', but torch {torch.__version__} sees no CUDA GPU here")
        self.dtype = resolve_dtype(config.dtype, config.device)
        tp = self._start_tensor_parallel(config)
        try:
            self._build(config, tp)
        except BaseException:
            if tp is not None:  # the other ranks wait for rank 0: stop them
                for proc in tp[1]:
                    proc.terminate()
                tp[0].destroy()
            raise

    def _build(self, config: EngineConfig, tp) -> None:
        if tp is None:
            torch.set_num_threads(config.num_threads or usable_cores())
            # GGUF blocks are read in place through the C++ kernels (built once per process; the runner
            # hands the same object to the model, the attention and the sampler).
            kernels = CpuKernels.from_config(config) if config.gguf_in_place else None
            loaded = load_model(config.model, self.dtype, config.device, config.keep_dequantized_weights,
                                revision=config.revision, kernels=kernels)
            rank_cfg = loaded.config
        else:
            loaded, rank_cfg = load_rank(config, tp[0])
        self.model_config = loaded.config
        self.model_path = loaded.path
        self.served_model_name = config.served_model_name or loaded.name
        self.tokenizer = Tokenizer(loaded.path, loaded.config.architecture)
        cfg = loaded.config
        self.max_model_len = self._max_model_len(config.max_model_len)
        elem = torch.tensor([], dtype=self.dtype).element_size()
        # With tensor parallelism, a rank's block holds its own KV heads only: the bytes (and the budget,
        # kv_cache_memory_gb) are per rank, and every rank holds the same number of blocks.
        self.block_bytes = bytes_per_block(cfg.num_layers, rank_cfg.num_kv_heads, cfg.head_dim, config.block_size,
                                           elem)
        if config.device == "cuda" and config.num_kv_blocks is None and config.kv_cache_memory_gb is None:
            num_blocks = self._gpu_num_blocks(loaded.model)
        else:
            num_blocks = self._num_blocks()
        if tp is not None:
            tp[0].broadcast(num_blocks)
        cap = capacity(self.block_bytes, num_blocks * self.block_bytes, config.block_size)
        logger.info(
            "KV cache: %d blocks × %s = %s%s, %d tokens; %d concurrent requests of max_model_len %d fit",
            num_blocks, human_bytes(self.block_bytes), human_bytes(num_blocks * self.block_bytes),
            f" on each of {config.tensor_parallel_size} ranks" if tp is not None else "",
            cap.num_tokens, cap.max_concurrency(self.max_model_len), self.max_model_len,
        )
        self.kv_caches = allocate_kv_cache(rank_cfg, num_blocks, config.block_size, self.dtype, config.device,
                                           config.huge_pages)
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len),
            self.kv_manager,
        )
        # The runner owns the C++ kernels (none with attention_backend="torch_ref": a pure-PyTorch
        # reference path end to end), the attention backend and the sampler.
        self.runner = ModelRunner(loaded.model, self.kv_caches, config, loaded.gguf_blocks)
        if config.device == "cuda" and not config.enforce_eager and self.runner.backend.name == "triton":
            from pagedserve.worker.cuda_graph import default_sizes

            sizes = config.cuda_graph_sizes or default_sizes(config.max_num_seqs)
            self.runner.enable_decode_graphs(sizes, -(-self.max_model_len // config.block_size))
        # The engine runs steps only through the executor (one process, or rank 0 of a tensor-parallel group).
        self.executor = UniProcExecutor(self.runner) if tp is None else MultiprocExecutor(self.runner, *tp)
        # Multi-step decoding (EngineConfig.num_scheduler_steps; None: 1; LLM.generate sets its own while it runs),
        # in one process only: tensor-parallel ranks run one forward per broadcast step.
        self.num_scheduler_steps = config.num_scheduler_steps or 1
        self._multi_step_capable = tp is None
        self.weight_bytes = loaded.model.weight_bytes()  # after the matmul set-up (its packed copies count)
        logger.info("weights: %s held in memory%s", human_bytes(self.weight_bytes),
                    " (GGUF blocks read in place)" if loaded.model.holds_blocks else "")
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self.generators = RequestGenerators(config.device)
        self.parents: dict[str, ParentState] = {}
        self.sample_to_parent: dict[str, ParentState] = {}
        self.step_records: deque[StepRecord] = deque(maxlen=config.max_step_records)
        self.step_count = 0
        self.eos_token_ids = frozenset(cfg.eos_token_ids) | frozenset(self.tokenizer.turn_end_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        # Structured outputs: grammars compile off this thread; a request waits here (not in the scheduler)
        # until its grammar is ready: parent id -> (its samples, the future of its compiled matcher).
        self.structured = StructuredOutputManager(self.tokenizer, cfg.vocab_size, sorted(self.eos_token_ids))
        self._awaiting_grammar: dict[str, tuple[list[Request], Future]] = {}
        self._step_mask = None  # the structured-output mask of the step running now (for its record)
        self._step_taken: dict[str, int] = {}  # this step: request id -> the tokens it took (a run's K/V kept)
        # Speculative decoding: proposals (n-gram lookup or a draft model) checked by the target each step.
        self.speculative_config = SpeculativeConfig.from_value(config.speculative_config)
        self.speculator = Speculator.create(self.speculative_config, self) if self.speculative_config else None
        self._step_spec: tuple[dict[str, list[int]], dict[str, int]] = ({}, {})  # this step's drafts, accepted
        # Running totals (metrics read these).
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_computed_prefill_tokens = 0
        self.finished_by_reason: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self._finished_between_steps: dict[str, str] = {}  # aborts, reported in the next step record

    @staticmethod
    def _start_tensor_parallel(config: EngineConfig):
        """(TPGroup, local rank processes) with tensor_parallel_size > 1, after checking the model splits."""
        if config.tensor_parallel_size == 1:
            return None
        from pagedserve.model.loader import load_model_config

        if config.batch_invariant:
            raise ValueError("batch_invariant: not with tensor_parallel_size > 1 (the strict mode is checked on one "
                             "process only)")
        tp_plan(load_model_config(config.model, revision=config.revision)[0], config.tensor_parallel_size)
        return start_group(config)

    def shutdown(self) -> None:
        """Stop the executor's workers (the tensor-parallel ranks); one process: nothing to do."""
        self.executor.shutdown()

    # ---- sizing ----------------------------------------------------------------------------------
    def _max_model_len(self, requested: int | None) -> int:
        cfg = self.model_config
        limit = cfg.max_position_embeddings
        if requested is None:
            return limit
        if requested > limit:
            raise ValueError(f"max_model_len: {requested} exceeds the model's context length ({limit})")
        return requested

    def _gpu_num_blocks(self, model) -> int:
        """On a GPU: the blocks that gpu_memory_utilization of its memory holds after the weights and a
        warm-up step's peak activations (worker/gpu_memory.py)."""
        from pagedserve.attention import get_backend
        from pagedserve.worker.gpu_memory import CudaMemory, plan_kv_cache

        c = self.config
        plan = plan_kv_cache(model, get_backend(c.attention_backend), self.model_config,
                             weight_bytes=model.weight_bytes(), utilization=c.gpu_memory_utilization,
                             num_tokens=min(c.max_num_batched_tokens, self.max_model_len * c.max_num_seqs),
                             num_seqs=c.max_num_seqs, block_size=c.block_size, dtype=self.dtype,
                             device=c.device, memory=CudaMemory(c.device))
        logger.info("GPU memory: %s; the KV cache gets %s", plan.describe(), human_bytes(max(plan.kv_cache, 0)))
        return plan.num_blocks(self.block_bytes)

    def _num_blocks(self) -> int:
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        budget = c.kv_cache_memory_gb * 1024**3 if c.kv_cache_memory_gb else default_kv_cache_bytes()
        n = int(budget // self.block_bytes)
        if n < 1:
            raise ValueError(
                f"kv_cache_memory_gb: {budget / 1024**3:.4f} GiB holds no block of {human_bytes(self.block_bytes)}"
            )
        return n

    # ---- requests --------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt")
                return (None if text is None else check_text("prompt", text)), self._check_ids(ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return prompt, self.tokenizer.encode(check_text("prompt", prompt))
        if isinstance(prompt, list | tuple):
            return None, self._check_ids(list(prompt))
        raise ValueError(f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}")

    def _check_ids(self, ids) -> list[int]:
        """Prompt token ids: each needs a row of the model's embedding."""
        if not isinstance(ids, list | tuple) or not ids:
            raise ValueError("prompt_token_ids: must be a non-empty list of token ids")
        vocab = self.model_config.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt_token_ids: {t!r} is not a token id in [0, {vocab})")
        return list(ids)

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids within the vocabulary (the larger of the
        model's and the tokenizer's: ids the model can never produce simply never match), top_k."""
        vocab = max(self.model_config.vocab_size, self.tokenizer.vocab_size)
        bad = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids: {bad} is not a token id in [0, {vocab})")
        if params.top_k > self.model_config.vocab_size:
            raise ValueError(f"top_k: {params.top_k} exceeds the vocabulary ({self.model_config.vocab_size}); "
                             "use 0 or -1 for no top-k")

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validate, then add all n samples or none (a ValueError naming the field leaves no trace)."""
        params = params or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if request_id in self.parents:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        self._check_params(params)
        # The samples' own ids (an n > 1 request's "id#i") must not meet a live sample's: "x#0" beside a running
        # "x" of n = 2 would share its state and break every later step.
        sample_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        if taken := next((rid for rid in sample_ids if rid in self.sample_to_parent), None):
            raise ValueError(f"request_id: {request_id!r} collides with the running sample {taken!r}")
        text, ids = self.tokenize_prompt(prompt)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if max_tokens < 1:
            raise ValueError(
                f"prompt: {len(ids)} tokens leave no room to generate within max_model_len ({self.max_model_len})"
            )
        self.scheduler.check_fits(len(ids), max_tokens)
        now = arrival_time or time.time()
        requests = []
        for i in range(params.n):
            sp = params if params.n == 1 or params.seed is None else params.clone(seed=params.seed + i)
            requests.append(Request(sample_ids[i], ids, sp, self.eos_token_ids, max_tokens, now, request_id, i))
        parent = ParentState(request_id, text, ids, [self.output_processor.new_sample(r) for r in requests],
                             RequestMetrics(arrival_time=now))
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.structured.submit(params.structured_outputs)
            if grammar.done() and grammar.exception() is not None:
                raise grammar.exception()  # a cached spec that fails: nothing is added
        # Nothing above touched the engine's state; from here on nothing can fail.
        for req in requests:
            self.sample_to_parent[req.request_id] = parent
            self.generators.add(req.request_id, req.sampling_params.seed)
        self.parents[request_id] = parent
        self.num_prompt_tokens += len(ids)
        if grammar is None or grammar.done():
            self._schedule_samples(requests, grammar)
        else:  # compiling: it joins the batch in the first step after its grammar is ready
            self._awaiting_grammar[request_id] = (requests, grammar)

    def _schedule_samples(self, requests: list[Request], grammar: Future | None) -> None:
        if grammar is not None:
            matcher = grammar.result()
            for req in requests:
                self.structured.add(req.request_id, matcher.deep_copy() if len(requests) > 1 else matcher)
        for req in requests:
            self.scheduler.add_request(req)

    def _admit_compiled(self, touched: dict, finished: dict) -> None:
        """Requests whose grammar finished compiling join the scheduler (or fail, with the compile error)."""
        if not self._awaiting_grammar:
            return
        if not self.scheduler.has_unfinished_requests():  # nothing else to do: wait a little, do not spin
            wait_futures([f for _, f in self._awaiting_grammar.values()], timeout=0.05, return_when=FIRST_COMPLETED)
        for pid, (requests, grammar) in list(self._awaiting_grammar.items()):
            if not grammar.done():
                continue
            del self._awaiting_grammar[pid]
            parent = self.parents[pid]
            if grammar.exception() is not None:
                parent.error = str(grammar.exception())
                self._abort_samples(parent, finished)
                touched[pid] = parent
            else:
                self._schedule_samples(requests, grammar)

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Abort requests in any state; their blocks are freed at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for rid in ids:
            parent = self.parents.get(rid)
            if parent is None:
                continue
            self._abort_samples(parent, self._finished_between_steps)
            outputs.append(self.output_processor.make_output(parent))
            self._drop(parent)
        return outputs

    def abort_all(self) -> list[RequestOutput]:
        """Abort every unfinished request (Ctrl-C in a CLI, shutdown of a server)."""
        return self.abort_request(list(self.parents))

    def _abort_samples(self, parent: ParentState, finished: dict, keep_cached: bool = True) -> None:
        """Finish every unfinished sample of `parent` as aborted (its blocks are freed at once)."""
        self._awaiting_grammar.pop(parent.request_id, None)
        for sample in parent.samples:
            req = sample.request
            if not req.is_finished:
                if req.request_id in self.scheduler.requests:
                    self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED, keep_cached)
                else:  # still waiting for its grammar: never scheduled, holds nothing
                    req.status = RequestStatus.FINISHED_ABORTED
                self._count_finish(req, finished)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._awaiting_grammar)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    # ---- the read API --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        pool, kv = self.kv_manager.pool, self.kv_manager
        cached_free = pool.num_cached_free_blocks
        return EngineStats(
            step_count=self.step_count,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + sum(len(r) for r, _ in self._awaiting_grammar.values()),
            num_unfinished_requests=len(self.parents),
            num_kv_blocks=pool.num_blocks,
            num_used_blocks=pool.num_used_blocks,
            num_cached_free_blocks=cached_free,
            num_free_blocks=pool.num_free_blocks - cached_free,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_computed_prefill_tokens=self.num_computed_prefill_tokens,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            finished_by_reason=dict(self.finished_by_reason),
            spec_decode=self.speculator.stats.copy() if self.speculator is not None else None,
        )

    def get_request(self, request_id: str) -> RequestInfo | None:
        """A live sequence by id (a sample id for n > 1: "<id>#<i>"); None once it finished."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        return RequestInfo(
            request_id=req.request_id, parent_id=req.parent_id, status=req.status.value,
            arrival_time=req.arrival_time, num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens, num_computed_tokens=req.num_computed_tokens,
            max_tokens=req.max_tokens, holds_blocks=bool(self.kv_manager.block_table(req.request_id)),
        )

    def live_requests(self) -> list[RequestInfo]:
        """Every running, then every waiting sequence, in the scheduler's order."""
        reqs = list(self.scheduler.running) + list(self.scheduler.waiting)
        return [info for r in reqs if (info := self.get_request(r.request_id)) is not None]

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block that no request holds (benchmarks start cold this way)."""
        self.kv_manager.pool.reset_prefix_cache()

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        pool = self.kv_manager.pool
        pool.num_allocated = pool.num_freed = pool.num_evicted = 0
        q0, h0 = self.kv_manager.prefix_queries, self.kv_manager.prefix_hits
        start = time.time()
        touched: dict[str, ParentState] = {}
        finished, self._finished_between_steps = self._finished_between_steps, {}
        self._admit_compiled(touched, finished)
        self._step_spec = ({}, {})
        self._step_taken = {}
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.step_count, self.max_model_len,
                                    self.structured.matchers.__contains__)
        sched = self.scheduler.schedule(self._num_steps())
        self._step_mask = None
        if sched.is_empty and not touched and not finished and self._awaiting_grammar:
            return []  # only waiting for grammars to compile: nothing to record
        if not sched.is_empty:
            self._run(sched, touched, finished, start)
        self.num_preemptions += len(sched.preempted)
        self._record(sched, start, finished, q0, h0)
        outputs = []
        for parent in touched.values():
            outputs.append(self.output_processor.make_output(parent))
            if parent.finished:
                self._drop(parent)
        return outputs

    def _num_steps(self) -> int:
        """How many decode steps the next schedule may run in a row (num_scheduler_steps): 1 unless every running
        request decodes plainly greedily (no penalties, logprobs, grammar, drafts, min_tokens left) in one process.
        The runner checks the rest (the decode stack, the greedy head)."""
        n = self.num_scheduler_steps
        if (n <= 1 or not self._multi_step_capable or self.speculator is not None or self.structured.matchers
                or self.runner.on_logits is not None):
            return 1
        for req in self.scheduler.running:
            p = req.sampling_params
            if not p.greedy or has_penalty(p) or p.logprobs is not None or req.num_output_tokens < p.min_tokens:
                return 1
        return n

    def _run(self, sched: SchedulerOutput, touched: dict, finished: dict, start: float) -> None:
        for s in sched.scheduled:
            parent = self.sample_to_parent[s.request_id]
            if parent.metrics.first_scheduled_time is None:
                parent.metrics.first_scheduled_time = start
            if s.is_prefill:
                self.num_computed_prefill_tokens += len(s.token_ids)
        seeded = self.generators.states(s.request_id for s in sched.scheduled if s.sample)
        try:
            sampled = self._execute(sched)
        except Exception:  # a broken batch: find the request(s) responsible and fail only those
            logger.exception("model step of %d requests failed; running each alone to find the failing ones",
                             len(sched.scheduled))
            self.generators.restore(seeded)  # seeded requests draw as if the failed attempt never was
            sampled = self._execute_one_by_one(sched, touched, finished)
            # Aborted requests (and their n > 1 siblings) leave this step.
            sched = dataclasses.replace(
                sched, scheduled=[s for s in sched.scheduled if s.request_id in self.scheduler.requests])
            sampled = {rid: v for rid, v in sampled.items() if rid in self.scheduler.requests}
        now = time.time()

        def on_token(req: Request, i: int, token: int) -> bool:
            parent = self.sample_to_parent[req.request_id]
            touched[parent.request_id] = parent
            self._step_taken[req.request_id] = i + 1
            self._on_token(parent, req, token, sampled[req.request_id][1][i], now)
            if req.is_finished:
                self._count_finish(req, finished)
                return True
            return False

        drafts = {s.request_id: s.spec_token_ids for s in sched.scheduled if s.spec_token_ids}
        proposed = [r for r in self.scheduler.running if r.spec_token_ids] if self.speculator else []
        self.scheduler.update(sched, {rid: toks for rid, (toks, _) in sampled.items()}, on_token)
        if self.speculator is not None:
            accepted = {rid: len(sampled[rid][0]) - 1 for rid in drafts if rid in sampled}
            self._step_spec = ({rid: list(d) for rid, d in drafts.items()}, accepted)
            for req in proposed:
                self.speculator.on_verified(req, len(drafts.get(req.request_id, ())),
                                            accepted.get(req.request_id, 0), self.step_count)
                req.spec_token_ids = []  # not scheduled this step: the next one proposes afresh

    def _execute(self, sched: SchedulerOutput) -> dict[str, tuple[list[int], list[Any]]]:
        """Run the model and the sampler on a step: request id -> (tokens, their logprobs) of each sampling
        row: one token, or with drafts the accepted ones and one more."""
        rows = self.runner.sample_rows(sched)
        requests = [self.scheduler.requests[sched.scheduled[r].request_id] for r in rows]
        # One sampling row per scored position: a request with k drafts has k + 1.
        sampling = [req for r, req in zip(rows, requests, strict=True)
                    for _ in range(1 + len(sched.scheduled[r].spec_token_ids))]
        # The grammar masks of constrained rows are filled in a thread while the model runs.
        mask = self.structured.start_masks([r.request_id for r in sampling]) if self.structured.matchers else None
        self._step_mask = mask
        meta = SamplingMetadata.from_requests(sampling, self.generators.for_requests(sampling),
                                              self.model_config.vocab_size, mask, self.config.device) if rows else None
        result = self.executor.execute(sched, meta)
        if result is None:
            return {}
        if isinstance(result, VerifyOutput | StepsOutput):
            return {r.request_id: (t, lp) for r, t, lp in zip(requests, result.token_ids, result.logprobs, strict=True)}
        return {r.request_id: ([t], [lp])
                for r, t, lp in zip(requests, result.token_ids, result.logprobs, strict=True)}

    def _execute_one_by_one(self, sched: SchedulerOutput, touched: dict, finished: dict) -> dict:
        """After a failed step: each scheduled request alone (re-writing a K/V slot writes the same values,
        and nothing has advanced yet). Those that fail again are aborted with the error; their blocks
        leave the prefix cache, since their K/V may be incomplete."""
        sampled: dict[str, tuple[int, Any]] = {}
        for s in sched.scheduled:
            if s.request_id not in self.scheduler.requests:
                continue  # a sibling sample failed already
            try:
                sampled.update(self._execute(SchedulerOutput(scheduled=[s])))
            except Exception as e:
                logger.warning("request %s failed on its own: %s", s.request_id, e)
                parent = self.sample_to_parent[s.request_id]
                parent.error = f"engine error: {e}"
                self._abort_samples(parent, finished, keep_cached=False)
                touched[parent.request_id] = parent
        return sampled

    def _on_token(self, parent: ParentState, req: Request, token: int, logprob, now: float) -> None:
        self.num_generation_tokens += 1
        if parent.metrics.first_token_time is None:
            parent.metrics.first_token_time = now
        parent.metrics.last_token_time = now
        grammar_done, grammar_error = self.structured.accept(req.request_id, token)
        try:
            status = self.output_processor.on_token(parent.samples[req.index], token, logprob)
        except Exception as e:  # e.g. a tokenizer failure: this request ends, the others go on
            logger.exception("output processing failed for %s", req.request_id)
            parent.error = f"output processing failed: {e}"
            status = RequestStatus.FINISHED_ABORTED
        if grammar_error is not None:  # only this request ends; the others in the step go on
            logger.warning("request %s: %s", req.request_id, grammar_error)
            parent.error = grammar_error
            status = RequestStatus.FINISHED_ABORTED
        elif status is None and grammar_done:  # the grammar is complete: nothing but EOS could follow
            status = RequestStatus.FINISHED_STOPPED
        if status is not None:
            self.scheduler.finish(req, status)

    def _count_finish(self, req: Request, finished: dict) -> None:
        reason = req.status.finish_reason or "abort"
        finished[req.request_id] = reason
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1

    def _drop(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        self._awaiting_grammar.pop(parent.request_id, None)
        for s in parent.samples:
            self.sample_to_parent.pop(s.request.request_id, None)
            self.generators.drop(s.request.request_id)
            self.structured.drop(s.request.request_id)
            if self.speculator is not None:
                self.speculator.drop(s.request.request_id)

    def _record(self, sched: SchedulerOutput, start: float, finished: dict, q0: int, h0: int) -> None:
        pool = self.kv_manager.pool
        mask = self._step_mask
        cached_free = pool.num_cached_free_blocks
        keep = self.config.keep_block_tables
        rec = StepRecord(
            step=self.step_count,
            start_time=start,
            duration_s=time.time() - start,
            token_budget=self.config.max_num_batched_tokens,
            num_scheduled_tokens=sched.num_scheduled_tokens,
            num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_decode_tokens,
            # (a multi-step run: the tokens each request took, fewer than the run where a stop cut it)
            scheduled={s.request_id: self._step_taken.get(s.request_id, sched.num_steps) if sched.num_steps > 1
                       else len(s.token_ids) for s in sched.scheduled},
            prefill_requests=[s.request_id for s in sched.scheduled if s.is_prefill],
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            blocks_allocated=pool.num_allocated,
            blocks_freed=pool.num_freed,
            blocks_evicted=pool.num_evicted,
            num_used_blocks=pool.num_used_blocks,
            num_cached_free_blocks=cached_free,
            num_free_blocks=pool.num_free_blocks - cached_free,
            preempted=list(sched.preempted),
            finished=finished,
            prefix_cache_queries=self.kv_manager.prefix_queries - q0,
            prefix_cache_hits=self.kv_manager.prefix_hits - h0,
            num_constrained=0 if mask is None else len(mask.rows),
            mask_s=0.0 if mask is None else mask.seconds,
            mask_wait_s=0.0 if mask is None else mask.wait_seconds,
            num_spec_tokens=sched.num_spec_tokens,
            num_accepted_tokens=sum(self._step_spec[1].values()),
            spec_drafts=self._step_spec[0],
            spec_accepted=self._step_spec[1],
            propose_s=self.speculator.last_propose_s if self.speculator is not None else 0.0,
            block_tables={s.request_id: s.block_table for s in sched.scheduled} if keep else None,
            num_steps=sched.num_steps,
        )
        self.step_records.append(rec)
        limit = self.config.max_block_table_records
        if keep and limit is not None and len(self.step_records) > limit:
            self.step_records[-limit - 1].block_tables = None  # bounded: only the newest keep their tables
        self.step_count += 1
