"""The decoder of every supported architecture (model/config.py's registry): Llama 2/3.x, Mistral, Qwen2 (qkv bias),
Qwen3 (QK-norm), Phi-3 / Phi-4-mini (partial rotary, LongRoPE), Gemma 2 and Gemma 3 (four norms per layer, GeGLU,
embedding scale, soft-capping, per-layer sliding windows and rotary bases), and SmolLM.

It works on a flat batch (all new tokens of all sequences concatenated) and attends over the paged KV cache through
an AttentionBackend. q/k/v and gate/up projections are fused at load time so each layer runs three big matmuls
instead of seven. Decode steps of the decoders `ModelConfig.stack_decoder` names (all but partial rotary,
Phi-4-mini's, and Gemma 2's soft-capped scores) run through the fused C++ DecodeStack, sliding windows included (its
decode kernel and the strict mode's row kernel take them); other steps run their layers op by op (with the C++
norms, rotary and KV write where they apply). With the C++ kernels every norm rounds as its family's reference does
in bf16: Gemma's once after the weight, the others' before it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.attention.backend import AttentionBackend, AttentionMetadata, write_kv
from pagedserve.kernels import CpuKernels
from pagedserve.model.config import ModelConfig
from pagedserve.model.layers import (
    Linear,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    gelu_tanh_and_mul,
    silu_and_mul,
)
from pagedserve.model.matmul import GEMV_MAX_ROWS, MatmulRoutes, QuantPart, QuantTensor, Route

KVCache = list[tuple[torch.Tensor, torch.Tensor]]
# Decode steps of up to this many sequences run all layers in one C++ call (kernels/csrc/decode_stack.cpp):
# every matmul of such a step is on its few-rows route. Steps of more sequences do too where every layer matmul
# has one route for all row counts (MatmulRoutes.one_route: GGUF blocks read in place, the strict mode).
DECODE_STACK_MAX_SEQS = GEMV_MAX_ROWS


class Attention(nn.Module):
    tp = None  # the tensor-parallel group (executor/tensor_parallel.py): o_proj's output is a partial sum

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.scale = cfg.attention_scale
        self.window = cfg.layer_window(layer_idx)
        self.softcap = cfg.attn_logit_softcapping
        # Gemma 3's sliding layers rotate with their own base; every other layer with the model's.
        self.rope_key = "local" if self.window is not None and cfg.rope_local_theta is not None else "global"
        self.full_rotary = cfg.rotary_dim == cfg.head_dim
        self.norm_once = cfg.spec.gemma_norms  # the C++ norms' rounding (see the module docstring)
        if cfg.spec.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, ropes, kv_cache, backend: AttentionBackend, meta: AttentionMetadata, kernels=None,
                rows: SampledRows | None = None):
        """rows: the last layer of a step where not every row samples. Every row's K/V is still written, but only
        those rows attend (as one-token sequences at their own context) and only their output is returned."""
        qkv = self.qkv_proj(x)
        rope = ropes[self.rope_key]
        if self.q_norm is not None and kernels is not None:
            kernels.rms_norm_heads(qkv, self.q_norm.weight, self.k_norm.weight, self.num_heads, self.num_kv_heads,
                                   self.q_norm.eps, self.norm_once)
        elif self.q_norm is not None:
            # RMSNorm over each head of q and k (before the rotary), written back into qkv.
            q = qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(-1, self.num_kv_heads, self.head_dim)
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        attend = {"window": self.window, "softcap": self.softcap}
        if kernels is not None and self.full_rotary:
            # One pass: rotary on q and k in place inside qkv, and K/V written into the paged cache.
            kernels.rotary_write_kv(qkv, rope[0], rope[1], kv_cache[0], kv_cache[1], meta.slot_mapping,
                                    self.num_heads, self.num_kv_heads)
            q = qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim)
            if rows is not None:
                return self._rows_out(q, rows, kv_cache, backend, attend)
            out = backend.forward(q, None, None, kv_cache[0], kv_cache[1], meta, self.scale, **attend)
            return self._out(out.view(-1, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if rows is not None:
            write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
            return self._rows_out(q, rows, kv_cache, backend, attend)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, **attend)
        return self._out(out.reshape(-1, self.q_size))

    def _rows_out(self, q: torch.Tensor, rows: SampledRows, kv_cache, backend: AttentionBackend,
                  attend: dict) -> torch.Tensor:
        """The attention output of the sampled rows only (their K/V, like every row's, already in the cache)."""
        if rows.meta is None:  # no row samples: nothing after the K/V write is needed
            return q.new_empty((0, self.o_proj.out_features))
        out = backend.forward(q[rows.index], None, None, kv_cache[0], kv_cache[1], rows.meta, self.scale, **attend)
        return self._out(out.reshape(-1, self.q_size))

    def _out(self, heads: torch.Tensor) -> torch.Tensor:
        out = self.o_proj(heads)
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    tp = None  # the tensor-parallel group: down_proj's output is a partial sum

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gelu = cfg.spec.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor, kernels=None) -> torch.Tensor:
        act = None if self.gelu or kernels is None else self.gate_up_proj.silu_and_mul(x)
        if act is None:
            gate_up = self.gate_up_proj(x)
            if self.gelu:
                act = kernels.gelu_tanh_and_mul(gate_up) if kernels is not None else gelu_tanh_and_mul(gate_up)
            else:
                act = kernels.silu_and_mul(gate_up) if kernels is not None else silu_and_mul(gate_up)
        out = self.down_proj(act)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        # Llama: the norm before the MLP. Gemma (sandwich norms): the norm of the attention's output.
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.spec.sandwich_norms
        self.norm_once = cfg.spec.gemma_norms  # the C++ norms' rounding (see the module docstring)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, ropes, kv_cache, backend, meta, kernels=None, rows: SampledRows | None = None):
        """Returns (x, residual): with kernels, the residual add is deferred into the next fused norm
        (vLLM's scheme, the layer's output is x + residual); without, residual stays None. rows (the last layer
        of a step where not every row samples): every row's K/V is written, and only those rows come out."""
        if self.sandwich:
            return self._forward_sandwich(x, residual, ropes, kv_cache, backend, meta, kernels, rows)
        attn = self.self_attn
        if kernels is None:
            x = _take(x, rows) + attn(self.input_layernorm(x), ropes, kv_cache, backend, meta, rows=rows)
            return (x if _no_rows(rows) else x + self.mlp(self.post_attention_layernorm(x))), None
        ln1, ln2, once = self.input_layernorm, self.post_attention_layernorm, self.norm_once
        if residual is None:
            residual, x = x, kernels.rms_norm(x, ln1.weight, ln1.eps, once)
        else:
            kernels.fused_add_rms_norm(x, residual, ln1.weight, ln1.eps, once)
        x, residual = attn(x, ropes, kv_cache, backend, meta, kernels, rows), _take(residual, rows)
        if _no_rows(rows):
            return x, residual
        kernels.fused_add_rms_norm(x, residual, ln2.weight, ln2.eps, once)
        return self.mlp(x, kernels), residual

    def _forward_sandwich(self, x, residual, ropes, kv_cache, backend, meta, kernels, rows):
        """Gemma: x + post_norm(attn(norm(x))), then the same around the MLP."""
        ln1, post_attn = self.input_layernorm, self.post_attention_layernorm
        pre_ffn, post_ffn = self.pre_feedforward_layernorm, self.post_feedforward_layernorm
        attn = self.self_attn
        if kernels is None:
            x = _take(x, rows) + post_attn(attn(ln1(x), ropes, kv_cache, backend, meta, rows=rows))
            return (x if _no_rows(rows) else x + post_ffn(self.mlp(pre_ffn(x)))), None
        once = self.norm_once
        if residual is None:
            residual, x = x, kernels.rms_norm(x, ln1.weight, ln1.eps, once)
        else:
            kernels.fused_add_rms_norm(x, residual, ln1.weight, ln1.eps, once)
        x, residual = attn(x, ropes, kv_cache, backend, meta, kernels, rows), _take(residual, rows)
        if _no_rows(rows):
            return x, residual
        x = kernels.rms_norm(x, post_attn.weight, post_attn.eps, once)
        kernels.fused_add_rms_norm(x, residual, pre_ffn.weight, pre_ffn.eps, once)
        x = self.mlp(x, kernels)
        return kernels.rms_norm(x, post_ffn.weight, post_ffn.eps, once), residual


def _take(x: torch.Tensor, rows: SampledRows | None) -> torch.Tensor:
    return x if rows is None else x[rows.index]


def _no_rows(rows: SampledRows | None) -> bool:
    """A last layer where no row samples: after its K/V write nothing is left (its output has no rows)."""
    return rows is not None and rows.meta is None


@dataclass(slots=True)
class SampledRows:
    """The rows of a step whose logits are taken, for its last layer (LlamaForCausalLM.forward): nothing but the
    model's output reads that layer's other rows, so after writing their K/V it computes these rows only."""

    index: torch.Tensor  # [n] int64: rows of the flat batch (logits_indices), each the last row of its sequence
    meta: AttentionMetadata | None  # those rows as one-token sequences at their own context; None when n == 0

    @staticmethod
    def of(meta: AttentionMetadata, index: torch.Tensor) -> SampledRows | None:
        """None (the last layer computes every row) unless each row is the last of its sequence, as the model
        runner's logits_indices are."""
        if index.numel() == 0:
            return SampledRows(index, None)
        # Sequence i holds rows query_start_loc[i] .. query_start_loc[i + 1] - 1.
        ends = meta.query_start_loc[1:]
        seqs = torch.searchsorted(ends, index, right=True)
        host = seqs.tolist()
        if max(host) >= len(meta.query_lens) or not bool((ends[seqs] - 1 == index).all()):
            return None
        sub = AttentionMetadata(
            slot_mapping=meta.slot_mapping[index],
            block_tables=meta.block_tables[seqs],
            seq_lens=meta.seq_lens[seqs],
            query_start_loc=torch.arange(len(host) + 1, dtype=torch.long, device=index.device),
            query_lens=[1] * len(host),
            seq_lens_host=[meta.seq_lens_host[i] for i in host],
            block_size=meta.block_size,
        )
        return SampledRows(index, sub)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if self.lm_head is not None:
            self.lm_head.routes.float32_out = True  # float32 logits in every dtype
        # The tied LM head's matmul (the embedding's weight); an untied head is a Linear with its own.
        self.tied_head_routes = MatmulRoutes()
        self.tied_head_routes.float32_out = True
        self.embed_quant: QuantPart | None = None  # the embedding as GGUF blocks read in place (then meta)
        self._stack_any_rows = False  # DecodeStack for any number of sequences (every layer matmul on one route)
        self.embed_fixed: torch.Tensor | None = None  # the tied head's packed copy, when the plain one is released
        self._block_kernels: CpuKernels | None = None  # the kernels that packed the GGUF blocks read in place
        # pagedserve's C++ CPU kernels (fused norm/rotary/SwiGLU, DecodeStack), handed over by the model
        # runner through set_kernels; None: plain PyTorch.
        self.kernels: CpuKernels | None = None
        self._stack = None  # (kv_caches, C++ DecodeStack, strict attention) for the decode steps it takes
        self.max_positions = max_positions or cfg.max_position_embeddings
        # Tensor parallelism (executor/tensor_parallel.py): this rank's rows of the vocabulary, from
        # vocab_start; None: the whole model here.
        self.tp = None
        self.vocab_start, self.vocab_per_rank = 0, cfg.vocab_size
        self.build_rotary()

    def build_rotary(self, device: torch.device | str | None = None) -> None:
        """The cos/sin tables (the global one, and Gemma 3's sliding layers' own); float32, on `device`."""
        cfg, n = self.config, self.max_positions
        self.rotary = RotaryEmbedding(cfg.rotary_dim, n, cfg.rope_theta, cfg.rope_scaling)
        self.rotary_local = None
        if cfg.rope_local_theta is not None:
            self.rotary_local = RotaryEmbedding(cfg.rotary_dim, n, cfg.rope_local_theta, None)
        if device is not None:
            self.rotary.to(device)
            if self.rotary_local is not None:
                self.rotary_local.to(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCache,
        backend: AttentionBackend,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,
        greedy: bool = False,
    ) -> torch.Tensor:
        """Float32 logits (in every dtype: the head sums and returns float32) of the rows in
        `logits_indices` (each sequence's last new token), or of every token. greedy: the caller takes each row's
        argmax and nothing else; where the head can fuse it (MatmulRoutes.argmax: the bf16 GGUF head, no
        soft-capping, one rank) the result is int64 [rows] instead, those argmaxes (-1 for a row with a NaN logit),
        and the logits are never written."""
        # Windows are per layer (each Attention passes its own to the backend); the step's metadata
        # carries none.
        meta.sliding_window = None
        cfg = self.config
        x = self._input_embeddings(input_ids)
        kernels = self.kernels if x.device.type == "cpu" else None
        # Every row samples (decode steps): the indices are 0..T-1 (prepare_inputs lists them in increasing order).
        all_rows = logits_indices is None or logits_indices.shape[0] == x.shape[0]
        if self._decode_stack_applies(backend, meta):
            # A few decoding sequences: every layer in one C++ call (same kernels, same order), the rotary tables
            # looked up there and, when every row samples, the final norm applied there too.
            x = self._stack_forward(self._decode_stack(kv_caches, backend.row_invariant), x, positions,
                                    meta.slot_mapping, meta.block_tables, meta.seq_lens, all_rows)
            normed = all_rows
        else:
            rope = self.rotary.cos_sin(positions)
            ropes = {"global": rope}
            if self.rotary_local is not None:
                ropes["local"] = self.rotary_local.cos_sin(positions)
            backend.prepare(meta)  # once per step, for every layer (the stack needs none of it)
            residual = None
            # The last layer computes past its K/V write only the rows that sample (SampledRows).
            rows = None if all_rows else SampledRows.of(meta, logits_indices)
            last = len(self.layers) - 1
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                x, residual = layer(x, residual, ropes, kv_cache, backend, meta, kernels, rows if i == last else None)
            if residual is not None:
                x = x + residual
            normed = False
            all_rows = all_rows or rows is not None  # then x holds only the sampled rows
        if not normed:
            if not all_rows:
                x = x[logits_indices]
            if kernels is None:
                x = self.norm(x)
            else:
                x = kernels.rms_norm(x, self.norm.weight, self.norm.eps, cfg.spec.gemma_norms)
        head = self._head_routes
        if greedy and self.tp is None and cfg.final_logit_softcapping is None:
            ids = head.argmax(x)
            if ids is not None:
                return ids
        weight = self._head_weight
        logits = head(x, weight, None)
        if logits.dtype != torch.float32:  # float32 already on the CPU routes
            logits = logits.float()
        if self.tp is not None:  # each rank scored its slice of the vocabulary
            logits = self.tp.all_gather_last(logits)[:, : cfg.vocab_size]
        if cfg.final_logit_softcapping is not None:  # Gemma 2
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def greedy_steps(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCache,
                     backend: AttentionBackend, meta: AttentionMetadata, num_steps: int) -> torch.Tensor | None:
        """Multi-step greedy decoding (the engine's num_scheduler_steps): num_steps decode steps of these
        sequences (one new token each, every row sampling), each step's argmaxes the next one's input tokens.
        int64 [steps, B]: step s's argmax of each row, as forward(greedy=True) and the sampler's greedy path take
        it one step at a time (a -1, a NaN logit, ends the run: see below). The K/V of
        positions[b] + s is written to the slot the block tables give it, so each sequence needs those slots.
        None (and nothing run) where a step would not run on the decode stack: the C++ kernels, one rank, no
        final-logit soft-capping."""
        cfg = self.config
        if self.tp is not None or cfg.final_logit_softcapping is not None or \
                not self._decode_stack_applies(backend, meta):
            return None
        meta.sliding_window = None
        stack = self._decode_stack(kv_caches, backend.row_invariant)
        # Every step's positions, slots and lengths at once: [steps, B] (row s contiguous).
        step = torch.arange(num_steps).unsqueeze(1)
        pos = positions.unsqueeze(0) + step
        seq_lens = meta.seq_lens.unsqueeze(0) + step
        bs = meta.block_size
        slots = (meta.block_tables.gather(1, (pos // bs).T).T * bs + pos % bs).contiguous()
        head = self._head_routes
        in_cpp = (head.bf16_argmax_part(input_ids.shape[0]) is not None and self.embed_quant is not None
                  and self.embed_fixed is None)
        run = self._steps_in_cpp if in_cpp else self._steps_in_python
        return run(stack, input_ids, pos, slots, meta.block_tables, seq_lens)

    def _steps_in_cpp(self, stack, input_ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """greedy_steps with a GGUF embedding and a bf16 GGUF head: the whole run in one C++ call
        (DecodeStack.greedy_steps: the calls of _steps_in_python's loop)."""
        head = self._head_routes
        part, embed, local = head.bf16_argmax_part(input_ids.shape[0]), self.embed_quant, self.rotary_local
        return stack.greedy_steps(input_ids, embed.packed, embed.type_id, self.dtype, self.config.embed_scale,
                                  part.packed, part.type_id, part.n, self.rotary.cos, self.rotary.sin, slots,
                                  block_tables, seq_lens, None if local is None else local.cos,
                                  None if local is None else local.sin, pos, self.norm.weight,
                                  **({} if head.screen_i8 is None else {"head_screen": head.screen_i8}))

    def _steps_in_python(self, stack, input_ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """greedy_steps as a Python loop over one step's calls (any embedding and head)."""
        head = self._head_routes
        weight = self._head_weight
        # A -1 (NaN logit) fed back: the GGUF embedding and nn.Embedding refuse it (the step fails, and the engine
        # runs each request alone, one step, to find the one responsible); the fixed-order embedding would wrap it.
        check = self.embed_fixed is not None
        out = []
        ids = input_ids
        for s in range(pos.shape[0]):
            x = self._stack_forward(stack, self._input_embeddings(ids), pos[s], slots[s], block_tables, seq_lens[s],
                                    True)
            ids = head.argmax(x)
            if ids is None:  # logits, then the argmax the sampler's plain greedy path takes
                ids = self.kernels.argmax_rows(head(x, weight, None).float())
            out.append(ids)
            if check and int(ids.min()) < 0:
                break
        return torch.stack(out)

    @property
    def _head_routes(self) -> MatmulRoutes:
        """The LM head's matmul routes: its own Linear's, or the tied head's (the embedding's weight)."""
        return self.lm_head.routes if self.lm_head is not None else self.tied_head_routes

    @property
    def _head_weight(self) -> torch.Tensor:
        return self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight

    def _input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        if self.config.embed_scale is not None:  # Gemma: in the model's dtype, as transformers does
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    def _stack_forward(self, stack, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor, final_norm: bool) -> torch.Tensor:
        """One decode step through the C++ DecodeStack: the rotary tables looked up there and (final_norm) the
        model's last norm applied there too."""
        local = self.rotary_local
        return stack.forward(x, self.rotary.cos, self.rotary.sin, slot_mapping, block_tables, seq_lens,
                             None if local is None else local.cos, None if local is None else local.sin,
                             positions=positions, final_norm=self.norm.weight if final_norm else None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._embed_rows(input_ids)
        # Vocabulary-parallel: this rank's rows, zeros for the ids other ranks hold, summed over the ranks
        # (one non-zero term per token: the sum is exact).
        local = input_ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.vocab_per_rank)
        x = self._embed_rows(local.clamp(0, self.vocab_per_rank - 1))
        return self.tp.all_reduce(x.masked_fill(elsewhere.unsqueeze(-1), 0))

    def _embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_fixed is not None:  # rows of fixed_pack's [ceil(V/16), K, 16] layout
            return self.embed_fixed[input_ids // 16, :, input_ids % 16]
        if self.embed_quant is not None:
            p = self.embed_quant
            return self._block_kernels.quant_embedding(input_ids, p.packed, p.type_id, self.config.hidden_size,
                                                       self.dtype)
        return self.embed_tokens(input_ids)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the norms' weights are always dense, in the model's dtype)."""
        return self.norm.weight.dtype

    def _decode_stack_applies(self, backend: AttentionBackend, meta: AttentionMetadata) -> bool:
        cfg = self.config
        return (
            self.kernels is not None
            and self.tp is None  # a sharded layer all-reduces between its matmuls: op by op
            and self.kernels.decode_stack
            and cfg.stack_decoder
            and 0 < meta.num_seqs
            and (meta.num_seqs <= DECODE_STACK_MAX_SEQS or self._stack_any_rows)
            and backend.runs_decode_kernel(meta)
        )

    def _decode_stack(self, kv_caches: KVCache, strict_attention: bool):
        """The C++ DecodeStack over these weights and these caches (and the strict mode's attention when
        the backend runs it), built once per cache list."""
        if self._stack is None or self._stack[0] is not kv_caches or self._stack[2] != strict_attention:
            ext = self.kernels.ext

            def spec(m: Linear):
                return m.routes.decode_spec(self.kernels, m.weight, m.bias)

            def layer_spec(layer: DecoderLayer, k: torch.Tensor, v: torch.Tensor):
                attn, mlp = layer.self_attn, layer.mlp
                # ln2 is the norm before the MLP: Llama's post_attention_layernorm, Gemma's pre_feedforward_layernorm
                # (Gemma's post_attention_layernorm normalises the attention's output: attn_out_norm).
                sandwich = {}
                if layer.sandwich:
                    sandwich = {"attn_out_norm": layer.post_attention_layernorm.weight,
                                "mlp_out_norm": layer.post_feedforward_layernorm.weight}
                    ln2 = layer.pre_feedforward_layernorm.weight
                else:
                    ln2 = layer.post_attention_layernorm.weight
                qk = {} if attn.q_norm is None else {"q_norm": attn.q_norm.weight, "k_norm": attn.k_norm.weight}
                return ext.DecodeLayer(
                    layer.input_layernorm.weight, ln2, spec(attn.qkv_proj), spec(attn.o_proj),
                    spec(mlp.gate_up_proj), spec(mlp.down_proj), k, v, **qk, **sandwich,
                    local_rope=attn.rope_key == "local", window=attn.window or 0,
                )

            layers = [layer_spec(layer, k, v) for layer, (k, v) in zip(self.layers, kv_caches, strict=True)]
            cfg = self.config
            stack = ext.DecodeStack(layers, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps,
                                    self.layers[0].self_attn.scale, strict_attention,
                                    gelu=self.layers[0].mlp.gelu, norm_once=cfg.spec.gemma_norms)
            self._stack = (kv_caches, stack, strict_attention)
        return self._stack[1]

    def matmul_routes(self) -> list[MatmulRoutes]:
        """Every matmul's routes, the tied LM head's included."""
        routes = [m.routes for m in self.modules() if isinstance(m, Linear)]
        return routes + ([self.tied_head_routes] if self.lm_head is None else [])

    def set_kernels(self, kernels: CpuKernels | None) -> None:
        if kernels is not self.kernels:
            self.kernels = kernels
            self._stack = None

    def setup_matmuls(self, kernels: CpuKernels | None, *, pack: bool, batch_hint: int,
                      gguf_blocks: dict[str, tuple[int, torch.Tensor]] | None = None,
                      batch_invariant: bool = False, release_plain: bool = False) -> list[MatmulRoutes]:
        """Choose every matmul's routes (model/matmul.py): oneDNN pre-packing where `pack` and the CPU
        has native bf16, the C++ bf16 GEMV and the GGUF-block GEMVs where `kernels` offer them (and the
        dtype lets every route use the same weight values); the LM head returns float32 logits. The GGUF
        blocks are those the loader kept, fused here like the weights (q/k/v, gate/up); a fused matmul
        whose parts have different block types stays on the widened weights. batch_invariant: every
        matmul on the fixed-order C++ matmul. Returns every route."""
        blocks = {name.removeprefix("model."): v for name, v in (gguf_blocks or {}).items()}

        def fused(prefix: str, parts: list[str]):
            found = [blocks.get(f"{prefix}.{p}.weight") for p in parts]
            if any(f is None for f in found) or len({f[0] for f in found}) != 1:
                return None
            return found[0][0], torch.cat([f[1] for f in found]).contiguous()

        matmuls: list[tuple[MatmulRoutes, torch.Tensor, tuple | None, bool]] = []
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            for m, prefix, parts in (
                (attn.qkv_proj, "self_attn", ["q_proj", "k_proj", "v_proj"]), (attn.o_proj, "self_attn", ["o_proj"]),
                (mlp.gate_up_proj, "mlp", ["gate_proj", "up_proj"]), (mlp.down_proj, "mlp", ["down_proj"]),
            ):
                matmuls.append((m.routes, m.weight, fused(f"layers.{i}.{prefix}", parts), False))
        if self.lm_head is None:
            matmuls.append((self.tied_head_routes, self.embed_tokens.weight, blocks.get("embed_tokens.weight"), True))
        else:
            matmuls.append((self.lm_head.routes, self.lm_head.weight, blocks.get("lm_head.weight"), True))
        for routes, weight, qweight, head in matmuls:
            routes.setup(weight, kernels, pack=pack, batch_hint=batch_hint, qweight=qweight, float32_out=head,
                         batch_invariant=batch_invariant)
        self._stack_any_rows = all(r.one_route for r, _, _, head in matmuls if not head)
        self._stack = None
        if release_plain:
            self._release_plain_weights()
        return [r for r, _, _, _ in matmuls]

    # ---- weights -------------------------------------------------------------------------------
    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantTensor]], norm_offset: float = 0.0,
                        kernels: CpuKernels | None = None) -> None:
        """Load tensors named as in HF checkpoints, fusing q/k/v and gate/up on the way (Phi-3's come fused).

        Each parameter is materialised from its tensor (in the parameter's dtype and device) as it arrives,
        so a model built on the meta device never holds more than its weights. A QuantTensor (GGUF blocks
        read in place; needs `kernels`) is packed for the C++ quantized matmul and its parameter stays on
        the meta device: the blocks are the weight.

        norm_offset: added to every RMSNorm weight (in float32, before the cast): 1 for Gemma's HF
        checkpoints, whose norms scale by (1 + w), so every norm here is the plain x_hat * w (GGUF
        files store 1 + w already)."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[int, torch.Tensor | QuantTensor]] = {}
        loaded: set[str] = set()
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                target, slot = fused[parts[-2]]
                key = ".".join(parts[:-2] + [target, parts[-1]])
                pending.setdefault(key, {})[slot] = tensor
                if len(pending[key]) == (3 if target == "qkv_proj" else 2):
                    chunks = pending.pop(key)
                    self._load(params, key, [chunks[i] for i in sorted(chunks)], loaded, kernels)
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints still store a copy
            if norm_offset and name.endswith("norm.weight"):
                tensor = tensor.float() + norm_offset
            self._load(params, name, [tensor], loaded, kernels)
        missing = set(params) - loaded
        if pending or missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing | set(pending))[:8]}")
        if self.lm_head is None and self.embed_quant is not None:
            self.tied_head_routes.quant = [self.embed_quant]  # the tied head reads the same blocks

    def _load(self, params: dict[str, nn.Parameter], name: str, tensors: list, loaded: set[str],
              kernels: CpuKernels | None) -> None:
        if name not in params:
            raise ValueError(f"checkpoint has an unexpected weight {name!r}")
        p = params[name]
        quant = [t for t in tensors if isinstance(t, QuantTensor)]
        if quant and kernels is not None and name.endswith(".weight"):
            rows = sum(t.shape[0] for t in tensors)
            if len(quant) == len(tensors) and (rows, tensors[0].shape[1]) == tuple(p.shape):
                self._load_quant(name, quant, kernels)
                loaded.add(name)
                return
        dense = [self._dequantize(t, kernels) if isinstance(t, QuantTensor) else t for t in tensors]
        tensor = dense[0] if len(dense) == 1 else torch.cat(dense)
        if tuple(p.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
        module, attr = self._owner(name)
        device = p.device if p.device.type != "meta" else torch.device("cpu")
        setattr(module, attr, nn.Parameter(tensor.to(device=device, dtype=p.dtype).contiguous(), requires_grad=False))
        loaded.add(name)

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        path, _, attr = name.rpartition(".")
        return self.get_submodule(path), attr

    @staticmethod
    def _dequantize(t: QuantTensor, kernels: CpuKernels | None) -> torch.Tensor:
        """The float32 weight of blocks (a fused matmul whose parts are not all blocks widens them)."""
        if kernels is None:
            raise ValueError("model: GGUF blocks read in place need the C++ kernels")
        packed = kernels.quant_pack(t.raw, t.type_id)
        return kernels.quant_embedding(torch.arange(t.shape[0]), packed, t.type_id, t.shape[1], torch.float32)

    def _load_quant(self, name: str, parts: list[QuantTensor], kernels: CpuKernels) -> None:
        """Consecutive parts of one block type are packed together (one kernel call); the parameter stays
        on the meta device."""
        runs: list[list[QuantTensor]] = []
        for t in parts:
            if runs and runs[-1][-1].type_id == t.type_id:
                runs[-1].append(t)
            else:
                runs.append([t])
        quant = []
        for run in runs:
            raw = run[0].raw if len(run) == 1 else torch.cat([t.raw for t in run])
            packed = kernels.resident(kernels.quant_pack(raw.contiguous(), run[0].type_id))
            quant.append(QuantPart(run[0].type_id, packed, sum(t.shape[0] for t in run)))
        module, _ = self._owner(name)
        self._block_kernels = kernels
        if name == "embed_tokens.weight":
            self.embed_quant = quant[0]
        else:
            module.routes.quant = quant

    def _release_plain_weights(self) -> None:
        """Replace every plain weight that no route reads by a meta tensor of its shape (see setup_matmuls)."""

        def only_fixed(r: MatmulRoutes) -> bool:
            return r.fixed is not None and r.few_rows == r.many_rows == Route.FIXED

        def release(module: nn.Module) -> None:
            w = module.weight
            if w.device.type != "meta":
                module.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)

        for m in self.modules():
            if isinstance(m, Linear) and only_fixed(m.routes):
                release(m)
        if self.lm_head is None and self.embed_quant is None and only_fixed(self.tied_head_routes):
            self.embed_fixed = self.tied_head_routes.fixed
            release(self.embed_tokens)

    @property
    def holds_blocks(self) -> bool:
        """Some weights are GGUF blocks read in place."""
        return self.embed_quant is not None or any(r.quant for r in self.matmul_routes())

    def weight_bytes(self) -> int:
        """Bytes of every weight this model holds (dense parameters, GGUF blocks, packed copies): the union of
        the tensors' byte ranges, so views of one storage count once and packed copies side by side in an
        arena chunk (kernels/huge_pages.py) count by what they take, not by the chunk's size."""
        spans: list[tuple[int, int]] = []
        opaque = 0  # oneDNN's packed weights (MatmulRoutes.packed): no storage to take a pointer of

        def add(t: torch.Tensor | None) -> None:
            nonlocal opaque
            if t is None or t.device.type == "meta" or t.numel() == 0:
                return
            if t.is_mkldnn:
                opaque += t.numel() * t.element_size()
                return
            # elements from the first to the last
            extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
            spans.append((t.data_ptr(), t.data_ptr() + extent * t.element_size()))

        for p in self.parameters():
            add(p)
        parts = [self.embed_quant] if self.embed_quant is not None else []
        for r in self.matmul_routes():
            for t in (r.packed, r.fixed, r.weight_f32):
                add(t)
            if r.qgemv is not None:
                for t in r.qgemv.tensors():
                    add(t)
            parts += r.quant or []
        for part in parts:
            for t in part.packed:
                add(t)
        total, end = opaque, 0
        for lo, hi in sorted(spans):
            if hi > end:
                total += hi - max(lo, end)
                end = hi
        return total
