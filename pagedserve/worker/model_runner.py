"""SchedulerOutput → flat tensors → model → logits → sampled tokens.

The runner owns what runs on the device: the model, its KV cache tensors, the attention backend, the
sampler, and the C++ CPU kernels, which it hands to each of them (one typed `CpuKernels`, or None). The
flat batch concatenates every scheduled request's new tokens; positions, slot mappings, block tables and
query starts are built as Python lists and turned into one tensor each (cheaper than a dozen small tensor
ops for a decode step's handful of numbers; see prepare_inputs).
"""

from __future__ import annotations

import itertools
import logging

import torch

from pagedserve.attention import AttentionMetadata, get_backend
from pagedserve.config import EngineConfig
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.kernels import CpuKernels
from pagedserve.model.llama import KVCache, LlamaForCausalLM
from pagedserve.model.matmul import Route
from pagedserve.sampling.metadata import SamplingMetadata
from pagedserve.sampling.rejection_sampler import VerifyOutput, verify
from pagedserve.sampling.sampler import Sampler, SamplerOutput, StepsOutput, in_vocab

logger = logging.getLogger("pagedserve")


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: KVCache,
        config: EngineConfig,
        gguf_blocks: dict[str, tuple[int, torch.Tensor]] | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        # Strict batch invariance: every attention row through the fixed-order C++ kernel.
        self.backend = get_backend("batch_invariant" if config.batch_invariant else config.attention_backend)
        self.sampler = Sampler(config.seed, batch_invariant=config.batch_invariant, device=config.device)
        self.block_size = config.block_size
        # Optional observer of every step's logits: f(request ids, float32 logits [rows, vocab]) (tests of
        # batch invariance compare a request's logits across batches with it).
        self.on_logits = None
        self.device = config.device
        self.backend.check_device(config.device)
        self.graphs = None  # DecodeGraphs once enable_decode_graphs ran (CUDA graphs of decode steps)
        self.set_kernels(CpuKernels.from_config(config))
        if config.batch_invariant:
            if self.kernels is None:
                raise ValueError("batch_invariant: the C++ kernels could not be built here (see the warning "
                                 "above); the strict mode needs them")
            if model.config.attn_logit_softcapping is not None:
                raise ValueError("batch_invariant: attention soft-capping (Gemma 2) is not supported in the "
                                 "strict mode")
        if config.device == "cpu":
            # Each weight held once: a plain weight no route reads is released (the runner owns its model).
            routes = model.setup_matmuls(self.kernels, pack=config.pack_weights, batch_hint=config.max_num_seqs,
                                         gguf_blocks=gguf_blocks, batch_invariant=config.batch_invariant,
                                         release_plain=True)
            few = {r.few_rows for r in routes}
            if any(r.many_rows == Route.PACKED for r in routes):
                logger.info("bf16 matmul weights pre-packed for oneDNN (AMX / AVX512-BF16)%s",
                            "; decode-sized matmuls use the C++ GEMV" if Route.BF16_GEMV in few else "")
            if config.batch_invariant:
                logger.info("batch-invariant mode: every matmul and attention row on the fixed-order C++ kernels")
            if few & {Route.GGUF_ROWS, Route.GGUF_R16}:
                logger.info("decode-sized matmuls read the GGUF quantized blocks directly (exact float32 weights)")
            if Route.QUANT_I8 in few:
                import gguf

                names = "/".join(gguf.GGMLQuantizationType(t).name for t in sorted(self.kernels.quant_i8_types))
                logger.info("int8_activations: decode-sized matmuls over GGUF %s blocks quantize their activations to "
                            "int8 per 32 (llama.cpp's numerics, not the reference's)", names)

    def enable_decode_graphs(self, sizes: tuple[int, ...], max_blocks: int, capture=None) -> None:
        """Capture the model's decode steps at these batch sizes (worker/cuda_graph.py); `capture`: CUDA's by
        default (tests pass the eager stand-in). Needs the Triton backend (its kernels read every length
        from device tensors)."""
        from pagedserve.worker.cuda_graph import DecodeGraphs

        if self.backend.name != "triton":
            raise ValueError("cuda graphs: decode graphs need attention_backend='triton'")
        graphs = DecodeGraphs(self.model, self.kv_caches, self.backend, sizes, max_blocks, self.block_size,
                              self.device, capture)
        with torch.inference_mode():
            graphs.capture_all()
        self.graphs = graphs

    def set_kernels(self, kernels: CpuKernels | None) -> None:
        """Hand the one kernels object to everything that may use it: model, attention, sampler."""
        self.kernels = kernels
        self.model.set_kernels(kernels)
        self.backend.kernels = kernels
        self.sampler.kernels = kernels

    def prepare_inputs(self, out: SchedulerOutput):
        sched = out.scheduled
        # The attention sequences: a request's new tokens, except that a decode with k draft tokens is
        # unfolded into k + 1 one-token rows over the same block table, row j seeing the context up to its
        # own position (every row's K/V is written before any row reads, per layer). A verification is then
        # a batch of decodes: the decode kernels (and the one-call decode stack) score it, with the numbers
        # of plain decoding.
        seqs: list[tuple[int, int, list[int]]] = []  # (query length, start position, block table)
        for s in sched:
            if s.spec_token_ids:
                seqs.extend((1, s.start_pos + j, s.block_table) for j in range(len(s.token_ids)))
            else:
                seqs.append((len(s.token_ids), s.start_pos, s.block_table))
        # Built as Python lists and turned into tensors once each: a decode step of a few sequences is a handful
        # of numbers, and a dozen small tensor ops cost more than the lists (~0.45 vs ~0.1 ms per W2 step).
        bs = self.block_size
        query_lens = [q for q, _, _ in seqs]
        seq_lens = [a + q for q, a, _ in seqs]
        positions_l: list[int] = []
        slots: list[int] = []
        for q, a, table in seqs:
            for p in range(a, a + q):
                positions_l.append(p)
                slots.append(table[p // bs] * bs + p % bs)
        starts_l = [0, *itertools.accumulate(query_lens)]
        max_blocks = max(len(t) for _, _, t in seqs)
        if len(seqs) != len(sched):  # drafts: a request with k of them is scored at its last k + 1 positions
            rows, end = [], 0
            for s in sched:
                end += len(s.token_ids)
                if s.sample:
                    rows.extend(range(end - 1 - len(s.spec_token_ids), end))
        else:
            rows = [starts_l[i + 1] - 1 for i in self.sample_rows(out)]
        # The 1-d int64 inputs as one tensor, split into views (one tensor op instead of six).
        input_ids, positions, slot_mapping, query_start_loc, logits_indices, seq_lens_t = torch.tensor(
            [t for s in sched for t in s.token_ids] + positions_l + slots + starts_l + rows + seq_lens,
            dtype=torch.long,
        ).split([len(positions_l), len(positions_l), len(slots), len(starts_l), len(rows), len(seq_lens)])
        block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for _, _, t in seqs], dtype=torch.long)
        dev = self.device
        if dev != "cpu":
            input_ids, positions, slot_mapping, query_start_loc, logits_indices, seq_lens_t, block_tables = (
                t.to(dev) for t in (input_ids, positions, slot_mapping, query_start_loc, logits_indices, seq_lens_t,
                                    block_tables))
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens_t,
            query_start_loc=query_start_loc,
            query_lens=query_lens,
            seq_lens_host=seq_lens,
            block_size=self.block_size,
        )
        return input_ids, positions, meta, logits_indices

    def sample_rows(self, out: SchedulerOutput) -> list[int]:
        """Which scheduled rows sample a token this step (their chunk reaches the end of the known tokens)."""
        return [i for i, s in enumerate(out.scheduled) if s.sample]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput,
                sampling: SamplingMetadata | None) -> SamplerOutput | VerifyOutput | StepsOutput | None:
        """Run the step; the sampled tokens of the `sample_rows` (None when no row samples). With draft
        tokens in the step, what the rejection sampler kept of each sampling row's drafts (VerifyOutput);
        `sampling` then has one row per scored position. A multi-step schedule (out.num_steps > 1) whose rows all
        decode plainly greedily on the decode stack runs its steps in a row (StepsOutput); anywhere else one step
        (the lookahead slots go back when the scheduler takes the one token)."""
        inputs = self.prepare_inputs(out)
        greedy = self.only_argmax(out, sampling)
        if out.num_steps > 1 and greedy and self.graphs is None:
            input_ids, positions, meta, _ = inputs
            steps = self.model.greedy_steps(input_ids, positions, self.kv_caches, self.backend, meta, out.num_steps)
            if steps is not None:
                vocab = self.model.config.vocab_size
                rows = steps.T.tolist()
                for row in rows:
                    in_vocab(row, vocab)  # a NaN logit's -1: the step fails as a single one would
                return StepsOutput(rows, [[None] * len(row) for row in rows])
        return self.sample(out, sampling, self.forward(inputs, greedy))

    def only_argmax(self, out: SchedulerOutput, sampling: SamplingMetadata | None) -> bool:
        """Whether the step needs nothing of its logits but each row's argmax (then the model may hand those over
        instead, see forward): every row greedy with nothing to adjust or report (all_plain_greedy), no grammar
        mask, no drafts to verify, no observer of the logits."""
        return (sampling is not None and sampling.all_plain_greedy and sampling.token_mask is None
                and self.on_logits is None and not any(s.spec_token_ids for s in out.scheduled))

    @torch.inference_mode()
    def forward(self, inputs, greedy: bool = False) -> torch.Tensor:
        """The model on prepared inputs (prepare_inputs'): the float32 logits of the sampled rows, or with greedy
        (only_argmax) possibly their argmaxes, int64 [rows] (the model's greedy head). Tensor-parallel ranks other
        than 0 run only this, on the inputs rank 0 broadcast."""
        if self.graphs is not None and self.graphs.can_run(inputs):
            return self.graphs.run(inputs)
        input_ids, positions, meta, logits_indices = inputs
        return self.model(input_ids, positions, self.kv_caches, self.backend, meta, logits_indices, greedy=greedy)

    @torch.inference_mode()
    def sample(self, out: SchedulerOutput, sampling: SamplingMetadata | None,
               logits: torch.Tensor) -> SamplerOutput | VerifyOutput | None:
        """The step's logits (or, from the greedy head, its argmaxes: int64 [rows]) → its tokens (or its verified
        drafts)."""
        if logits.dtype == torch.int64:  # forward(greedy=True) took the argmaxes already
            return self.sampler.from_argmax(logits, self.model.config.vocab_size)
        rows = self.sample_rows(out)
        if self.on_logits is not None:
            ids = [out.scheduled[r].request_id for r in rows for _ in range(1 + len(out.scheduled[r].spec_token_ids))]
            self.on_logits(ids, logits)
        if sampling is None:
            return None
        if any(out.scheduled[r].spec_token_ids for r in rows):
            return verify(self.sampler, logits, sampling, [out.scheduled[r].spec_token_ids for r in rows])
        return self.sampler(logits, sampling)
