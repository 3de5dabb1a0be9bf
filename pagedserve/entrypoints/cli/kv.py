"""`pagedserve kv`: the KV block formula, worked out for a model or explicit numbers."""

from __future__ import annotations

import argparse

from pagedserve.core.kv_math import blocks_for_tokens, bytes_per_block, capacity, dtype_bytes, human_bytes


def run_kv(args: argparse.Namespace) -> int:
    explicit = (args.layers, args.kv_heads, args.head_dim)
    if any(v is not None for v in explicit) and not all(v is not None for v in explicit):
        raise ValueError("layers/kv-heads/head-dim: give all three, or --model")
    max_len = weights = cfg = None
    if all(v is not None for v in explicit):
        layers, kv_heads, head_dim = explicit
        source = "explicit numbers"
    else:
        from pagedserve.model.loader import estimate_weight_bytes, load_model_config

        cfg, name = load_model_config(args.model, revision=args.revision)
        layers, kv_heads, head_dim = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        max_len = cfg.max_position_embeddings
        source = f"model {name}"
        weights = estimate_weight_bytes(args.model, dtype_bytes(args.dtype), revision=args.revision)
    elem = dtype_bytes(args.dtype)
    tp = args.tensor_parallel_size
    rank_kv_heads = kv_heads
    if tp != 1:
        rank_kv_heads = _rank_kv_heads(kv_heads, tp, cfg)
    block = bytes_per_block(layers, rank_kv_heads, head_dim, args.block_size, elem)
    print(f"KV cache block ({source}, {args.dtype}{f', on each of {tp} tensor-parallel ranks' if tp != 1 else ''}):")
    if tp != 1:
        shared = "replicated: each KV head on " + str(tp // kv_heads) + " ranks" if kv_heads < tp else "split"
        print(f"  {kv_heads} kv_heads over {tp} ranks ({shared}): {rank_kv_heads} per rank")
    print(
        f"  2 × {layers} layers × {rank_kv_heads} kv_heads × {head_dim} head_dim × {args.block_size} block_size"
        f" × {elem} bytes = {block} bytes ({human_bytes(block)}) per block"
    )
    print(f"  = {human_bytes(block / args.block_size)} per token")
    if weights is not None:
        print(f"weights ({source}, other tensors in {args.dtype}): {human_bytes(weights)} held in memory "
              "(GGUF quantized matrices as stored, read in place)")
    if args.request_len is not None and args.request_len < 1:
        raise ValueError(f"request-len: must be >= 1, got {args.request_len}")
    req_len = args.request_len or max_len
    if req_len:
        per_req = blocks_for_tokens(req_len, args.block_size)
        print(f"  a request of {req_len} tokens (prompt + output) needs {per_req} blocks = "
              f"{human_bytes(per_req * block)}")
    if args.memory_gb is not None:
        if args.memory_gb <= 0:
            raise ValueError(f"memory-gb: must be > 0, got {args.memory_gb}")
        cap = capacity(block, args.memory_gb * 1024**3, args.block_size)
        print(f"  {args.memory_gb:g} GiB holds {cap.num_blocks} blocks = {cap.num_tokens} tokens")
        if req_len:
            print(f"  {cap.max_concurrency(req_len)} concurrent requests of {req_len} tokens fit")
        if tp != 1:
            print(f"  (--memory-gb is per rank, as kv_cache_memory_gb is: {tp} ranks hold {tp * args.memory_gb:g} GiB"
                  " of KV cache in all)")
    elif args.request_len:
        print("  (give --memory-gb to see how many such requests fit at once)")
    return 0


def _rank_kv_heads(kv_heads: int, tp: int, cfg) -> int:
    """KV heads one rank holds (executor/tensor_parallel.py's plan: split, or replicated when fewer than
    ranks); with a model, its whole plan is checked (query heads and MLP width must divide too)."""
    if tp < 1:
        raise ValueError(f"tensor-parallel-size: must be >= 1, got {tp}")
    if cfg is not None:
        from pagedserve.executor.tensor_parallel import plan

        return plan(cfg, tp).num_kv_heads
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size: {kv_heads} KV heads neither divide among {tp} ranks nor "
                         "replicate evenly")
    return max(1, kv_heads // tp)
