"""ModelConfig: the numbers and features a decoder of a supported family needs, read from config.json or
GGUF metadata, and the registry of supported architectures.

Every supported family is one decoder (model/llama.py) with switches: Llama 2/3.x, Mistral and Qwen2/2.5
(the plain pre-norm SwiGLU decoder), Qwen3 (RMSNorm on q and k per head), Phi-3 / Phi-4-mini (fused qkv and
gate_up in the checkpoint, partial rotary, LongRoPE), Gemma 2 (four norms per layer, GeGLU, embedding scale,
attention and final logit soft-capping, alternating sliding window) and Gemma 3 (as Gemma 2 without
soft-capping, with QK-norm and interleaved sliding / global layers with their own rotary bases).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ArchSpec:
    """One supported architecture: its names and the features its decoder switches on."""

    name: str  # pagedserve's name (ModelConfig.architecture)
    hf_names: tuple[str, ...]  # HF `architectures` entries
    gguf_names: tuple[str, ...]  # GGUF `general.architecture`
    qk_norm: bool = False  # RMSNorm over each head of q and k before the rotary embedding
    sandwich_norms: bool = False  # Gemma: norms after attention and after the MLP too (four per layer)
    gemma_norms: bool = False  # HF checkpoints store w for a norm that scales by (1 + w)
    hidden_act: str = "silu"  # the gated MLP's activation: silu (SwiGLU) | gelu_pytorch_tanh (GeGLU)
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size)
    fused_checkpoint: bool = False  # the checkpoint stores qkv_proj and gate_up_proj fused (Phi-3)
    permute_gguf_qk: bool = False  # llama.cpp interleaved the rotary halves of q/k rows at conversion


ARCHITECTURES: tuple[ArchSpec, ...] = (
    ArchSpec("llama", ("LlamaForCausalLM",), ("llama",), permute_gguf_qk=True),
    ArchSpec("mistral", ("MistralForCausalLM",), ("mistral",), permute_gguf_qk=True),
    ArchSpec("qwen2", ("Qwen2ForCausalLM",), ("qwen2",)),
    ArchSpec("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qk_norm=True),
    ArchSpec("phi3", ("Phi3ForCausalLM",), ("phi3",), fused_checkpoint=True),
    ArchSpec("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), sandwich_norms=True, gemma_norms=True,
             hidden_act="gelu_pytorch_tanh", embed_scale=True),
    ArchSpec("gemma3", ("Gemma3ForCausalLM",), ("gemma3",), qk_norm=True, sandwich_norms=True, gemma_norms=True,
             hidden_act="gelu_pytorch_tanh", embed_scale=True),
)
ARCH_BY_NAME = {a.name: a for a in ARCHITECTURES}
ARCH_BY_HF = {n: a for a in ARCHITECTURES for n in a.hf_names}
ARCH_BY_GGUF = {n: a for a in ARCHITECTURES for n in a.gguf_names}
# Kept for callers that list what is supported.
SUPPORTED_ARCHITECTURES = {n: a.name for n, a in ARCH_BY_HF.items()}


def unsupported_architecture(found: Any, source: str = "config.json") -> ValueError:
    return ValueError(
        f"unsupported architecture {found!r} in {source}: pagedserve supports "
        f"{', '.join(sorted(ARCH_BY_HF))} (GGUF: {', '.join(sorted(ARCH_BY_GGUF))})"
    )


@dataclass
class ModelConfig:
    architecture: str  # a name in ARCH_BY_NAME
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    o_proj_bias: bool = False  # Llama's attention_bias also puts a bias on o_proj (Qwen2's does not)
    mlp_bias: bool = False  # Llama's mlp_bias: gate/up/down carry a bias
    # The attention window of the layers whose layer_types entry is "sliding_attention" (every layer when
    # layer_types is None: Mistral). A token sees the last `sliding_window` positions, itself included.
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer: "full_attention" | "sliding_attention"
    # Rotary embedding of the sliding layers when it differs from the global one (Gemma 3: base 10000).
    rope_local_theta: float | None = None
    partial_rotary_factor: float = 1.0  # the rotary embedding covers the first head_dim * factor dims
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma); else head_dim
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def spec(self) -> ArchSpec:
        return ARCH_BY_NAME[self.architecture]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def embed_scale(self) -> float | None:
        return math.sqrt(self.hidden_size) if self.spec.embed_scale else None

    def layer_window(self, i: int) -> int | None:
        """Layer i's attention window, or None for full causal attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def has_sliding_window(self) -> bool:
        return any(self.layer_window(i) is not None for i in range(self.num_layers))

    @property
    def plain_decoder(self) -> bool:
        """The Llama-style decoder the fused C++ paths (DecodeStack, rotary + KV write) implement."""
        spec = self.spec
        return (not spec.qk_norm and not spec.sandwich_norms and spec.hidden_act == "silu"
                and not spec.embed_scale and self.partial_rotary_factor == 1.0
                and self.rope_local_theta is None and self.query_pre_attn_scalar is None
                and self.attn_logit_softcapping is None and self.final_logit_softcapping is None)

    @property
    def stack_decoder(self) -> bool:
        """A decoder DecodeStack runs (kernels/csrc/decode_stack.cpp): the plain one, and with QK-norm (Qwen3), the
        sandwich norms, GeGLU, the embedding scale, a second rotary base, the query_pre_attn_scalar and sliding
        windows (Gemma 3, Mistral) -- not partial rotary (Phi-4-mini) nor soft-capped attention scores (Gemma 2),
        which its kernels do not do."""
        return self.partial_rotary_factor == 1.0 and self.attn_logit_softcapping is None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        spec = next((ARCH_BY_HF[a] for a in archs if a in ARCH_BY_HF), None)
        if spec is None:
            raise unsupported_architecture(archs or cfg.get("model_type"))
        arch = spec.name
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        rope, local_rope = _rope_parameters(cfg)
        rope_theta = rope.get("rope_theta") or cfg.get("rope_theta") or _default_theta(arch)
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        scaling = None
        if rope_type != "default":
            scaling = dict(rope, rope_type=rope_type)
            if rope_type == "longrope":  # the lengths it needs live beside it in Phi-3 configs
                scaling.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
                scaling.setdefault("max_position_embeddings", cfg.get("max_position_embeddings"))
        partial = rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0
        window, layer_types = _sliding_window(arch, cfg)
        local_theta = None
        if local_rope is not None:
            if (local_rope.get("rope_type") or "default") != "default":
                raise ValueError("rope_parameters: a scaled rotary embedding on sliding layers is not supported")
            local_theta = float(local_rope.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0)
        gemma = spec.gemma_norms
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_proj_bias=arch in ("llama", "gemma2", "gemma3") and bool(cfg.get("attention_bias", False)),
            mlp_bias=arch == "llama" and bool(cfg.get("mlp_bias", False)),
            sliding_window=window,
            layer_types=layer_types,
            rope_local_theta=local_theta,
            partial_rotary_factor=float(partial),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)) if gemma else None,
            attn_logit_softcapping=cfg.get("attn_logit_softcapping") if arch == "gemma2" else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _default_theta(arch: str) -> float:
    return 1_000_000.0 if arch == "gemma3" else 10000.0


def _rope_parameters(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(global rope parameters, sliding layers' own or None). transformers 5 calls them rope_parameters
    (rope_theta folded in; Gemma 3 keys them by layer type); older configs use rope_scaling + rope_theta
    (+ rope_local_base_freq)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full = dict(params.get("full_attention") or {})
        local = params.get("sliding_attention")
        return full, dict(local) if local is not None else {"rope_type": "default"}
    rope = dict(params or cfg.get("rope_scaling") or {})
    if "rope_local_base_freq" in cfg or cfg.get("model_type") == "gemma3_text":
        return rope, {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    return rope, None


def _sliding_window(arch: str, cfg: dict[str, Any]) -> tuple[int | None, list[str] | None]:
    """(window, layer_types): which layers attend through a window, as transformers decides.

    Mistral and Phi-3 apply `sliding_window` (when set) to every layer. Qwen2/Qwen3 apply it only with
    use_sliding_window, and then to layers from max_window_layers on. Gemma 2 alternates sliding and
    global layers; Gemma 3 has one global layer every sliding_window_pattern (6). A config's own
    layer_types list wins.
    """
    window = cfg.get("sliding_window")
    num_layers = cfg["num_hidden_layers"]
    if window is None:
        return None, None
    if arch in ("mistral", "phi3"):
        return window, None
    if arch in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window", False):
            return None, None
        first = cfg.get("max_window_layers", 28)  # transformers' default
        kinds = cfg.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        ]
    elif arch in ("gemma2", "gemma3"):
        pattern = 2 if arch == "gemma2" else cfg.get("sliding_window_pattern", 6)
        kinds = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
        ]
    else:
        return None, None
    if len(kinds) != num_layers or any(k not in ("full_attention", "sliding_attention") for k in kinds):
        raise ValueError(f"layer_types: expected {num_layers} entries of full_attention / sliding_attention")
    if all(k == "full_attention" for k in kinds):
        return None, None
    return window, list(kinds)
