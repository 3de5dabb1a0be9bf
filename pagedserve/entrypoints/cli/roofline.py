"""`pagedserve bench roofline`: this machine's limits, and each workload's figure as a share of its limit.

Measured with torch on the threads the engine gets:
- GEMM rates (GFLOP/s) in float32 and bfloat16, on the matmul shapes of a prefill step (2048 rows);
- memory read bandwidth (GB/s): sums over a buffer far larger than the caches.

A workload's limit (what the machine could do if the engine ran at the roofline):
- prefill-heavy and batched work (W1, W3) is bound by the GEMM rate: tokens/s limit = GEMM rate /
  FLOPs per token (every matmul of every token, the LM head of each sampled row, and causal attention's
  QK^T and PV at each token's context length);
- single-stream decode (W2) is bound by memory: tokens/s limit = bandwidth / bytes one decode step reads
  (every matmul weight in the form its decode route reads: GGUF blocks, bf16, float32, packed; the LM
  head; the K/V of the context).

The measured limits are kept per machine (CPU model, flags, threads) under PAGEDSERVE_CACHE, so every
bench mode can add its `roofline` share without measuring again; `bench roofline` measures afresh.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import torch

from pagedserve.envs import ENV
from pagedserve.kernels import cpu_info

GEMM_ROWS = 1024  # rows of a prefill chunk
BANDWIDTH_BYTES = 512 * 1024**2  # well past every cache level


@dataclass
class Roofline:
    cpu: str
    flags: list[str]
    threads: int
    gemm_gflops: dict[str, float]  # dtype name -> GFLOP/s
    read_gb_s: float

    def key(self) -> str:
        return f"{self.cpu}|{','.join(self.flags)}|{self.threads}"


def best_of(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls of fn, after one warm-up call (thread pools, oneDNN primitives)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_gemm(dtype: torch.dtype, k: int = 1024, n: int = 2048, rows: int = GEMM_ROWS, repeats: int = 3) -> float:
    """GFLOP/s of x [rows, k] @ W.T [k, n] through F.linear (what the engine's plain route calls)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    secs = best_of(lambda: torch.nn.functional.linear(x, w), repeats)
    return 2.0 * rows * k * n / secs / 1e9


def measure_read_bandwidth(nbytes: int = BANDWIDTH_BYTES, repeats: int = 3) -> float:
    """GB/s of reading a float32 buffer (a sum: one read per element, nothing written)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    secs = best_of(lambda: buf.sum(), repeats)
    return nbytes / secs / 1e9


def measure(threads: int | None = None) -> Roofline:
    if threads is not None:
        torch.set_num_threads(threads)
    info = cpu_info()
    gemm = {name: measure_gemm(dt) for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    return Roofline(info.model_name, info.speed_flags, torch.get_num_threads(), gemm, measure_read_bandwidth())


def _cache_file():
    return ENV.cache_dir / "roofline.json"


def save(roof: Roofline) -> None:
    path = _cache_file()
    try:
        known = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        known = {}
    known[roof.key()] = asdict(roof)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(known, indent=2) + "\n")


def cached_or_measure() -> Roofline:
    """This machine's limits at the current thread count: from the cache, else measured (and kept)."""
    info = cpu_info()
    probe = Roofline(info.model_name, info.speed_flags, torch.get_num_threads(), {}, 0.0)
    try:
        known = json.loads(_cache_file().read_text())
        if probe.key() in known:
            return Roofline(**known[probe.key()])
    except (OSError, ValueError, TypeError):
        pass
    roof = measure()
    save(roof)
    return roof


# ---- what a workload costs ---------------------------------------------------------------------------
def matmul_flops_per_token(cfg) -> float:
    """2 × the multiply-adds of one token through every layer's q/k/v, o, gate/up and down projections."""
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    o = cfg.num_heads * d * h
    mlp = 3 * h * cfg.intermediate_size
    return 2.0 * cfg.num_layers * (qkv + o + mlp)


def head_flops(cfg) -> float:
    return 2.0 * cfg.hidden_size * cfg.vocab_size


def attention_flops(cfg, context: float) -> float:
    """QK^T and PV of one token over `context` keys, every layer and head."""
    return 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context


def batch_flops(cfg, num_prompts: int, input_len: int, output_len: int) -> float:
    """The FLOPs `num_prompts` requests of input_len + output_len tokens need: every token fed through the layers
    (the prompt and each output token but the last) with causal attention, except that the last layer needs no more
    than its K/V projections of the rows whose logits nobody takes (a prompt's rows but its last: llama.cpp's and
    pagedserve's SampledRows skip the rest), and the LM head on the output_len rows that are sampled."""
    fed = input_len + max(output_len - 1, 0)
    sampled = min(output_len, fed)
    layers = cfg.num_layers
    kv_only = 2.0 * cfg.hidden_size * 2 * cfg.num_kv_heads * cfg.head_dim
    matmuls = fed * matmul_flops_per_token(cfg) - (fed - sampled) * (matmul_flops_per_token(cfg) / layers - kv_only)
    # Token i attends to i + 1 keys; in the last layer only the sampled rows (positions fed - sampled .. fed - 1).
    keys = (layers - 1) * fed * (fed + 1) / 2 + sampled * (2 * fed - sampled + 1) / 2
    per_key = attention_flops(cfg, 1.0) / layers
    return num_prompts * (matmuls + output_len * head_flops(cfg) + keys * per_key)


def decode_read_bytes(model, cfg, context: float, kv_elem_bytes: int) -> float:
    """Bytes one single-sequence decode step reads: each matmul weight in the form its few-rows route
    reads, and the K/V of `context` positions."""
    from pagedserve.model.layers import Linear
    from pagedserve.model.matmul import Route

    def route_bytes(r, weight: torch.Tensor | None) -> int:
        if r.few_rows in (Route.QUANT, Route.QUANT_BF16, Route.QUANT_I8) and r.quant is not None:
            return sum(p.nbytes for p in r.quant)
        if r.few_rows in (Route.GGUF_R16, Route.GGUF_ROWS) and r.qgemv is not None:
            return sum(t.numel() * t.element_size() for t in r.qgemv.tensors())
        if r.few_rows == Route.FIXED and r.fixed is not None:
            return r.fixed.numel() * r.fixed.element_size()
        if r.few_rows == Route.LINEAR_F32 and r.weight_f32 is not None:
            return r.weight_f32.numel() * 4
        if weight is None or weight.device.type == "meta":
            return 0
        return weight.numel() * weight.element_size()

    total = 0
    for m in model.modules():
        if isinstance(m, Linear):
            total += route_bytes(m.routes, m.weight)
    if model.lm_head is None:
        total += route_bytes(model.tied_head_routes, model.embed_tokens.weight)
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_elem_bytes * context
    return float(total + kv)


def workload_limit(engine, mode: str, num_prompts: int, input_len: int, output_len: int,
                   roof: Roofline) -> dict:
    """The roofline limit of a bench run on this engine, in the unit the run reports, and what bounds it."""
    cfg = engine.model_config
    dtype = str(engine.dtype).removeprefix("torch.")
    gemm = roof.gemm_gflops.get(dtype) or max(roof.gemm_gflops.values())
    if mode == "latency":  # one stream: bound by the bytes each decode step reads
        context = input_len + output_len / 2
        elem = torch.tensor([], dtype=engine.dtype).element_size()
        per_token = decode_read_bytes(engine.runner.model, cfg, context, elem)
        return {"bound": "memory read", "read_gb_s": roof.read_gb_s, "bytes_per_token": per_token,
                "limit_decode_tokens_per_s": roof.read_gb_s * 1e9 / per_token}
    flops = batch_flops(cfg, num_prompts, input_len, output_len)
    seconds = flops / (gemm * 1e9)
    return {"bound": f"{dtype} GEMM", "gemm_gflops": gemm, "total_gflop": flops / 1e9,
            "limit_output_tokens_per_s": num_prompts * output_len / seconds,
            "limit_prompt_tokens_per_s": num_prompts * input_len / seconds}


def share_of_limit(result: dict, limit: dict) -> dict:
    """The run's figure as a share of its limit (a bench result's "roofline" entry). For batched runs one
    share covers both tokens/s figures: the time all the run's FLOPs take at the GEMM rate over the time
    the run took."""
    out = dict(limit)
    if "limit_decode_tokens_per_s" in limit and "decode_tokens_per_s" in result:
        out["share"] = result["decode_tokens_per_s"] / limit["limit_decode_tokens_per_s"]
    elif "total_gflop" in limit and result.get("elapsed_s"):
        out["share"] = (limit["total_gflop"] / limit["gemm_gflops"]) / result["elapsed_s"]
    return out


def add_roofline(result: dict, engine, mode: str, num_prompts: int, input_len: int, output_len: int) -> None:
    """result["roofline"]: the run against this machine's limits (CPU engines; None on a GPU)."""
    if engine.config.device != "cpu":
        result["roofline"] = None
        return
    roof = cached_or_measure()
    limit = workload_limit(engine, mode, num_prompts, input_len, output_len, roof)
    result["roofline"] = {"machine": asdict(roof), **share_of_limit(result, limit)}
