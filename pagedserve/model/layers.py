"""Building blocks of the supported decoders: RMSNorm, rotary embedding (default, linear, llama3, LongRoPE,
partial), SwiGLU / GeGLU, and the Linear layer whose matmul routes live in model/matmul.py."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model.matmul import MatmulRoutes


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op; it normalises in float32 internally like the reference implementation.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


ROPE_TYPES = ("default", "linear", "llama3", "longrope", "freq_factors")


def rope_inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None, long: bool = False) -> torch.Tensor:
    """The rotary inverse frequencies over `dim` rotated dimensions (transformers' formulas). long: LongRoPE's
    long-context factors instead of the short ones."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "freq_factors":  # GGUF's rope_freqs tensor: per-frequency divisors (llama3 scaling)
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        if factors.numel() != dim // 2:
            raise ValueError(f"rope_scaling: LongRoPE factors have {factors.numel()} entries, expected {dim // 2}")
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (factors * theta**shape)
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
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")


def longrope_attention_factor(scaling: dict[str, Any]) -> float:
    """LongRoPE's cos/sin multiplier: given, or sqrt(1 + ln(factor) / ln(original length)) (transformers)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding over the first `dim` dimensions of a head; cos/sin for every position
    are precomputed once.

    LongRoPE (Phi-3 / Phi-4-mini): positions below original_max_position_embeddings use the short factors,
    later ones the long factors, each position by itself (transformers switches every position of a
    forward pass to the long factors once the sequence outgrows the original length; per position, a
    request's rotations do not depend on its length or on the batch), both scaled by the attention factor.
    """

    def __init__(self, dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.dim = dim
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(dim, theta, scaling))
        mult = 1.0
        if scaling is not None and scaling["rope_type"] == "longrope":
            mult = longrope_attention_factor(scaling)
            original = scaling["original_max_position_embeddings"]
            long = torch.outer(t, rope_inv_freq(dim, theta, scaling, long=True))
            freqs = torch.where((t >= original).unsqueeze(1), long, freqs)
        cos, sin = freqs.cos(), freqs.sin()
        if mult != 1.0:
            cos, sin = cos * mult, sin * mult
        self.register_buffer("cos", cos, persistent=False)  # [max_pos, dim/2]
        self.register_buffer("sin", sin, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Looked up once per step and shared by every layer: [T, dim/2] each, float32."""
        return self.cos[positions], self.sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on the first 2 * cos.shape[-1] dims of [T, heads, D] (the rest pass through),
    computed in float32 and cast back."""
    half = cos.shape[-1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [T, 1, half]: broadcast over heads
    x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
    rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    if 2 * half == x.shape[-1]:
        return rot
    return torch.cat((rot, x[..., 2 * half :]), dim=-1)


class Linear(nn.Linear):
    """nn.Linear whose matmul takes the routes chosen for its weight at load (model/matmul.py)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.routes = MatmulRoutes()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.routes(x, self.weight, self.bias)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """SwiGLU of this [gate; up] projection in one kernel call where its route has one (see
        MatmulRoutes.silu_and_mul), else None."""
        return None if self.bias is not None else self.routes.silu_and_mul(x)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): gelu with the tanh approximation (transformers' gelu_pytorch_tanh) of the gate times up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
