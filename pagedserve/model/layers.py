"""Building blocks of the Llama family: RMSNorm, rotary embedding (with llama3 / linear scaling), SwiGLU."""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op; it normalises in float32 internally like the reference implementation.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "freq_factors":  # GGUF's rope_freqs tensor: per-frequency divisors (llama3 scaling)
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding; cos/sin for every position are precomputed once."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_pos, head_dim/2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Looked up once per step and shared by every layer: [T, head_dim/2] each, float32."""
        return self.cos[positions], self.sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on [T, heads, D], computed in float32 and cast back."""
    half = x.shape[-1] // 2
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [T, 1, half]: broadcast over heads
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


# Rows above which a bf16 matmul is done in float32 on CPUs without native bf16 math (AVX2 only): there
# the bf16 GEMM is emulated and ~3x slower than float32 once compute-bound, while for a few rows
# (decode of few sequences) it is memory-bound and bf16's halved weight traffic wins ~3x.
BF16_EMULATED_MAX_ROWS = 16


@functools.cache
def cpu_has_native_bf16() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except bf16 on a CPU without native bf16 with many rows: upcast, multiply, round back.

    Both routes take bf16 inputs and accumulate in float32, so they agree up to summation order.
    """
    if (
        weight.dtype == torch.bfloat16
        and x.shape[0] > BF16_EMULATED_MAX_ROWS
        and x.device.type == "cpu"
        and not cpu_has_native_bf16()
    ):
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), b).to(torch.bfloat16)
    return F.linear(x, weight, bias)


@functools.cache
def onednn_packing_available() -> bool:
    """oneDNN (mkldnn) can pre-pack bf16 weights for its AMX / AVX512-BF16 matmul kernels."""
    return (
        cpu_has_native_bf16()
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and os.environ.get("PAGEDSERVE_NO_PACK") != "1"
    )


def pack_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor | None:
    """The weight reordered once into oneDNN's blocked layout, or None where that does not apply.

    F.linear on a plain bf16 weight makes oneDNN reorder the whole weight at every call; packed once,
    a decode-sized matmul runs about twice as fast (memory-bound GEMV) and gives the same numbers.
    """
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not onednn_packing_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# Up to this many rows, a bf16 matmul is a GEMV bound by reading the weight once: the C++ kernel
# (AVX512-BF16 pair dot products over the plain row-major weight) streams it faster than oneDNN.
GEMV_MAX_ROWS = 4


class MatmulRoutes:
    """How one weight's matmul runs on the CPU, chosen once at load: from its GGUF blocks or through the
    bf16 GEMV for 1-4 rows, through oneDNN with the weight pre-packed otherwise (bf16 on native-bf16
    CPUs), and plain `linear` where none of these was set up. The plain weight stays the source of truth."""

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None
        self.gemv = None  # the C++ bf16 GEMV, where built (used with `packed`)
        self.qgemv: GgufMatmul | None = None

    def pack(self, weight: torch.Tensor, batch_hint: int, kernels=None) -> bool:
        self.packed = pack_weight(weight, batch_hint)
        self.gemv = bf16_gemv(kernels) if self.packed is not None else None
        return self.packed is not None

    def attach(self, qweight: tuple[int, torch.Tensor] | None, kernels) -> bool:
        """qweight: (ggml type id, uint8 blocks) of the weight, or None."""
        usable = qweight is not None and gguf_gemv_available(kernels)
        self.qgemv = GgufMatmul(kernels, *qweight) if usable else None
        return usable

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        few_rows = x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_ROWS
        if self.qgemv is not None and few_rows:
            return self.qgemv(x, bias)
        if self.packed is not None and x.dtype == torch.bfloat16 and x.dim() == 2:
            if self.gemv is not None and few_rows:
                return self.gemv(x, weight, bias)
            return packed_linear(x, self.packed, bias)
        return linear(x, weight, bias)


class Linear(nn.Linear):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.routes = MatmulRoutes()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.routes(x, self.weight, self.bias)


def repack_gguf(type_id: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF blocks [N, K/32 * block_bytes] regrouped by 16 rows for `gemv_gguf_r16`: quants
    [N/16, K/32, j, 16] (the j-th quant byte of 16 rows side by side), fp16 scales and mins
    [N/16, K/32, 16] (mins empty unless Q4_1). No value changes, only the order of the bytes."""
    n = blocks.shape[0]
    bb = {2: 18, 3: 20, 8: 34}[type_id]
    nb = blocks.shape[1] // bb
    b = blocks.view(n, nb, bb)
    q_start = 4 if type_id == 3 else 2

    def by16(t: torch.Tensor) -> torch.Tensor:  # [N, nb, X] -> [N/16, nb, X, 16]
        return t.reshape(n // 16, 16, nb, t.shape[-1]).permute(0, 2, 3, 1).contiguous()

    def halves(lo: int) -> torch.Tensor:  # fp16 field at byte offset lo of every block -> [N/16, nb, 16]
        return by16(b[:, :, lo : lo + 2].contiguous().view(torch.float16)).reshape(n // 16, nb, 16)

    mins = halves(2) if type_id == 3 else torch.empty(0, dtype=torch.float16)
    return by16(b[:, :, q_start:]), halves(0), mins


class GgufMatmul:
    """x @ W.T (+ bias) for 1-4 rows of x, W read from its GGUF blocks by the C++ kernels: regrouped by 16
    rows when the row count allows (no horizontal sums), else in GGUF's own row layout."""

    def __init__(self, kernels, type_id: int, blocks: torch.Tensor) -> None:
        self.type_id = type_id
        self.regrouped = blocks.shape[0] % 16 == 0 and hasattr(kernels, "gemv_gguf_r16")
        if self.regrouped:
            self.qs, self.scales, self.mins = repack_gguf(type_id, blocks)
            self.fn = kernels.gemv_gguf_r16
        else:
            self.blocks = blocks
            self.fn = kernels.gemv_gguf

    def tensors(self) -> list[torch.Tensor]:
        """What DecodeStack takes for this matmul."""
        return [self.qs, self.scales, self.mins] if self.regrouped else [self.blocks]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.regrouped:
            return self.fn(x, self.qs, self.scales, self.mins if self.mins.numel() else None, self.type_id, bias)
        return self.fn(x, self.blocks, self.type_id, bias)


def gguf_gemv_available(kernels) -> bool:
    """Whether the C++ GEMVs over GGUF Q4_0/Q4_1/Q8_0 blocks are built (AVX-512).
    PAGEDSERVE_NO_GGUF_GEMV=1 keeps decode matmuls on the widened (bf16/float32) weights."""
    return kernels is not None and os.environ.get("PAGEDSERVE_NO_GGUF_GEMV") != "1" and kernels.has_gguf_gemv()


def bf16_gemv(kernels):
    """The C++ bf16 GEMV where the kernels were built with AVX512-BF16, else None."""
    if kernels is None or os.environ.get("PAGEDSERVE_NO_GEMV") == "1" or not kernels.has_bf16_gemv():
        return None
    return kernels.gemv_bf16


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
