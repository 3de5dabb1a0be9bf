"""ModelConfig: the handful of numbers a Llama-family decoder needs, read from config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2"
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
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}: pagedserve supports "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        # transformers 5 calls it rope_parameters (and folds rope_theta into it); older configs use
        # rope_scaling + rope_theta.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        sliding = _sliding_window(arch, cfg)
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
            rope_scaling=None if rope_type == "default" else dict(rope, rope_type=rope_type),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_proj_bias=arch == "llama" and bool(cfg.get("attention_bias", False)),
            mlp_bias=arch == "llama" and bool(cfg.get("mlp_bias", False)),
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _sliding_window(arch: str, cfg: dict[str, Any]) -> int | None:
    """The attention window every layer uses, or None for full attention.

    Mistral applies `sliding_window` (when set) to every layer. Qwen2 applies it only with
    use_sliding_window, and then only to layers from max_window_layers on, which a single window per
    model cannot express unless that is all layers or none.
    """
    window = cfg.get("sliding_window")
    if arch == "mistral":
        return window
    if arch != "qwen2" or not cfg.get("use_sliding_window", False) or window is None:
        return None
    num_layers = cfg["num_hidden_layers"]
    first = cfg.get("max_window_layers", 28)  # transformers' default
    kinds = cfg.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
    ]
    if all(k == "full_attention" for k in kinds):
        return None
    if all(k == "sliding_attention" for k in kinds):
        return window
    raise ValueError(
        "sliding_window: Qwen2 with a window on some layers only (max_window_layers) is not supported"
    )
