"""Tensor parallelism (Megatron's scheme, as vLLM shards a Llama): which part of every weight a rank holds.

Per layer, rank r of N holds
- the attention: num_heads / N query heads (a contiguous run) with their key/value heads — num_kv_heads / N
  of them, or, with fewer KV heads than ranks, the one KV head its query heads read (replicated, as vLLM
  does: N must then be a multiple of num_kv_heads); qkv_proj is column-parallel (its rows of q, k and v),
  o_proj row-parallel (its columns), so the attention's output is a partial sum: one all-reduce;
- the MLP: intermediate_size / N of gate and up (column-parallel) and the same columns of down_proj
  (row-parallel): one all-reduce;
- the embedding and the LM head: a contiguous 1/N of the vocabulary (padded up so every rank holds the
  same number of rows). The embedding looks up its own ids (zero rows elsewhere) and all-reduces; the LM
  head's logits are all-gathered.
Norms, rotary tables and biases of column-parallel matmuls are replicated or sliced with their rows; a
row-parallel matmul's bias is added on rank 0 only (the sum adds it once).

Each rank keeps the KV cache of its own KV heads: the per-rank ModelConfig that `shard_model` returns
(num_heads, num_kv_heads, intermediate_size of the shard) is what the KV cache and its arithmetic use.
Weights are sliced after loading (each rank reads the whole checkpoint, keeps its part); GGUF blocks are
widened first: slices of quantized blocks along the columns would cut blocks in two.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pagedserve.executor.parallel_state import TPGroup
from pagedserve.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class TPPlan:
    size: int
    num_heads: int  # query heads per rank
    num_kv_heads: int  # KV heads per rank (1 when replicated)
    kv_replicas: int  # ranks that hold each KV head (1: none replicated)
    intermediate_size: int  # per rank
    vocab_per_rank: int  # rows of the embedding / LM head per rank (padded vocabulary / size)

    def kv_head_start(self, rank: int) -> int:
        return (rank // self.kv_replicas) * self.num_kv_heads

    def vocab_range(self, rank: int, vocab_size: int) -> tuple[int, int]:
        start = rank * self.vocab_per_rank
        return start, min(start + self.vocab_per_rank, vocab_size)


def plan(cfg: ModelConfig, size: int) -> TPPlan:
    """The per-rank shapes of `cfg` over `size` ranks; a ValueError naming tensor_parallel_size when the
    model does not split that way."""
    def fail(what: str) -> ValueError:
        return ValueError(f"tensor_parallel_size: {size} ranks cannot split this model: {what}")

    if cfg.num_heads % size:
        raise fail(f"it has {cfg.num_heads} attention heads, not a multiple of {size} "
                   f"(sizes that divide: {', '.join(str(d) for d in _divisors(cfg.num_heads))})")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        raise fail(f"its {cfg.num_kv_heads} KV heads neither divide among {size} ranks nor replicate evenly "
                   f"({size} is not a multiple of {cfg.num_kv_heads})")
    if cfg.intermediate_size % size:
        raise fail(f"its MLP width {cfg.intermediate_size} is not a multiple of {size}")
    replicas = 1 if cfg.num_kv_heads % size == 0 else size // cfg.num_kv_heads
    return TPPlan(size, cfg.num_heads // size, max(1, cfg.num_kv_heads // size), replicas,
                  cfg.intermediate_size // size, -(-cfg.vocab_size // size))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def rank_config(cfg: ModelConfig, p: TPPlan) -> ModelConfig:
    """The model config of one rank's shard (its KV cache is allocated from this)."""
    return dataclasses.replace(cfg, num_heads=p.num_heads, num_kv_heads=p.num_kv_heads,
                               intermediate_size=p.intermediate_size)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous().clone(), requires_grad=False)


def shard_model(model, cfg: ModelConfig, tp: TPGroup) -> ModelConfig:
    """Slice every weight of a loaded LlamaForCausalLM down to rank `tp.rank`'s part, in place, and hand the
    modules the group for their all-reduces. Returns the rank's ModelConfig."""
    p, r = plan(cfg, tp.size), tp.rank
    d = cfg.head_dim
    q_rows = slice(r * p.num_heads * d, (r + 1) * p.num_heads * d)
    kv0 = p.kv_head_start(r) * d
    kv_rows = slice(kv0, kv0 + p.num_kv_heads * d)
    i_rows = slice(r * p.intermediate_size, (r + 1) * p.intermediate_size)
    q_size, kv_size, inter = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _rows(attn.qkv_proj, lambda w: torch.cat([w[:q_size][q_rows], w[q_size : q_size + kv_size][kv_rows],
                                                  w[q_size + kv_size :][kv_rows]]))
        _cols(attn.o_proj, q_rows, r)
        _rows(mlp.gate_up_proj, lambda w: torch.cat([w[:inter][i_rows], w[inter:][i_rows]]))
        _cols(mlp.down_proj, i_rows, r)
        attn.num_heads, attn.num_kv_heads = p.num_heads, p.num_kv_heads
        attn.q_size, attn.kv_size = p.num_heads * d, p.num_kv_heads * d
        attn.tp = mlp.tp = tp
    lo, hi = p.vocab_range(r, cfg.vocab_size)

    def vocab_rows(w: torch.Tensor) -> torch.Tensor:
        part = w[lo:hi]
        pad = p.vocab_per_rank - part.shape[0]
        return torch.cat([part, part.new_zeros(pad, *part.shape[1:])]) if pad else part

    model.embed_tokens.weight = _param(vocab_rows(model.embed_tokens.weight.data))
    if model.lm_head is not None:
        _rows(model.lm_head, vocab_rows)
    model.tp = tp
    model.vocab_start = lo
    model.vocab_per_rank = p.vocab_per_rank
    return rank_config(cfg, p)


def _rows(linear, take) -> None:
    """Column-parallel: the rank's output rows of the weight (and of the bias)."""
    linear.weight = _param(take(linear.weight.data))
    if linear.bias is not None:
        linear.bias = _param(take(linear.bias.data))
    linear.out_features = linear.weight.shape[0]


def _cols(linear, cols: slice, rank: int) -> None:
    """Row-parallel: the rank's input columns; the bias once, on rank 0."""
    linear.weight = _param(linear.weight.data[:, cols])
    if linear.bias is not None and rank != 0:
        linear.bias = None
    linear.in_features = linear.weight.shape[1]
