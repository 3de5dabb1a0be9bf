"""EngineConfig: every knob of the engine in one validated dataclass.

Each field carries its command-line help in its metadata; `entrypoints/cli/args.py` derives the engine
flags of every command from these fields (names, types, defaults and choices come from here only).
Fields marked `cli=False` are set by the commands themselves or only through the Python API.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, Field, dataclass, field, fields

from pagedserve.envs import ENV

DEFAULT_KV_CACHE_FRACTION = 0.2  # of the memory available at start-up...
DEFAULT_KV_CACHE_MAX_GB = 2.0  # ...but never more than this

# Model dtypes: the names users give, each mapped to its canonical name ("auto" picks per device/CPU).
MODEL_DTYPES = ("auto", "float32", "bfloat16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}
ATTENTION_BACKENDS = ("auto", "batched", "torch_ref", "triton")
DEVICES = ("auto", "cpu", "cuda")


def canonical_dtype(name: str) -> str:
    """'fp32' -> 'float32', ...; a ValueError naming the field for anything else."""
    name = DTYPE_ALIASES.get(name, name)
    if name not in MODEL_DTYPES:
        raise ValueError(f"dtype: must be auto, float32 or bfloat16, got {name!r}")
    return name


def _knob(default, help: str, *, cli: bool = True, choices: tuple | None = None) -> Field:
    return field(default=default, metadata={"help": help, "cli": cli, "choices": choices})


def _env_knob(name: str, help: str, *, cli: bool = True) -> Field:
    """A field whose default is envs.ENV.<name> (the environment, read once at import)."""
    return field(default_factory=lambda: getattr(ENV, name), metadata={"help": help, "cli": cli, "choices": None})


@dataclass
class EngineConfig:
    # ---- model ----
    model: str | None = _knob(None, "HF model directory, .gguf file, or Hugging Face hub id org/name (or "
                              "org/name:QUANT for one GGUF of a GGUF repo) (default: the bundled model)")
    revision: str | None = _knob(None, "branch, tag or commit of a Hugging Face hub model id (default: main)")
    served_model_name: str | None = _knob(None, "the model name clients send (default: from the model)",
                                          cli=False)
    dtype: str = _knob("auto", "weights and activations: auto (bfloat16 where the CPU has native bf16, "
                       "else float32), float32 or bfloat16", choices=MODEL_DTYPES)
    device: str = _knob("auto", "where the model, the KV cache and the sampler run: cpu, cuda (bfloat16 by "
                        "default there), or auto (cuda when torch sees a GPU, else cpu)", choices=DEVICES)
    # ---- KV cache ----
    block_size: int = _knob(16, "tokens per KV block")
    num_kv_blocks: int | None = _knob(None, "exact number of KV blocks (wins over --kv-cache-memory-gb)")
    kv_cache_memory_gb: float | None = _knob(None, "KV cache size in GiB (default: 20%% of free memory, "
                                             "at most 2 GiB)")
    enable_prefix_caching: bool = _knob(True, "share the KV blocks of common prompt prefixes")
    gpu_memory_utilization: float = _knob(0.9, "on cuda: the share of the GPU's memory this engine may use; "
                                          "the KV cache gets what the weights and a warm-up step's peak "
                                          "activations leave of it")
    # ---- scheduler ----
    max_num_seqs: int = _knob(128, "most sequences in one step")
    max_num_batched_tokens: int = _knob(2048, "token budget of one step")
    max_model_len: int | None = _knob(None, "context length (default: the model's)")
    seed: int = _knob(0, "seed of the engine's sampler (requests without their own seed)")
    num_scheduler_steps: int | None = _knob(
        None, "decode steps run per scheduling step (vLLM's multi-step scheduling): while every running request "
        "decodes greedily with nothing to adjust or report and none waits, the model runs this many steps back to "
        "back, each feeding its argmaxes to the next, and the engine takes their tokens at once (the same tokens as "
        "one step at a time; stop strings, EOS and max_tokens cut them where single steps would have stopped). "
        "Default: 8 for the offline API (LLM, pagedserve bench), 1 elsewhere (a server streams token by token)")
    # ---- compute paths (the defaults come from envs.py's variables) ----
    attention_backend: str = _knob("auto", "attention over the paged cache: batched (C++ decode kernel + "
                                   "SDPA), torch_ref (the pure-PyTorch reference, no C++ anywhere), triton "
                                   "(the CUDA kernels), or auto (triton on cuda, batched on cpu)",
                                   choices=ATTENTION_BACKENDS)
    enforce_eager: bool = _knob(False, "on cuda: run decode steps op by op instead of replaying CUDA graphs")
    cuda_graph_sizes: tuple[int, ...] | None = _knob(
        None, "on cuda: the decode batch sizes captured as CUDA graphs (a step is padded up to the next one; "
        "default 1, 2, 4, 8, then every 8 up to max_num_seqs, at most 256)", cli=False)
    num_threads: int | None = _knob(None, "torch threads (default: the cores this process may use)")
    use_cpp_kernels: bool = _env_knob(
        "use_cpp_kernels", "pagedserve's C++ CPU kernels (fused ops, decode attention, GEMVs); off: pure PyTorch")
    cpu_arch: str = _env_knob(
        "cpu_arch", "-march of the C++ kernels' build, e.g. x86-64-v3 for the portable AVX2 build")
    pack_weights: bool = _env_knob(
        "pack_weights", "pre-pack bf16 matmul weights for oneDNN (CPUs with native bf16)")
    bf16_gemv: bool = _env_knob(
        "bf16_gemv", "decode-sized bf16 matmuls through the C++ GEMV (AVX512-BF16 builds)")
    gguf_gemv: bool = _env_knob(
        "gguf_gemv", "decode-sized matmuls read GGUF Q4_0/Q4_1/Q8_0 blocks directly (AVX-512 builds)")
    gguf_in_place: bool = _env_knob(
        "gguf_in_place", "matmuls and the embedding read a GGUF's quantized blocks in place (Q4_0/1, Q5_0/1, "
        "Q8_0, Q4_K, Q5_K, Q6_K; needs the C++ kernels); off: dequantize at load into the model's dtype")
    decode_stack: bool = _env_knob(
        "decode_stack", "decode steps of up to 4 sequences (of any number where every matmul runs one route at "
        "every row count: GGUF blocks read in place, the strict mode) run every layer in one C++ call")
    amx: bool = _env_knob(
        "amx", "bf16 matmuls over GGUF blocks and the bf16 prefill attention on AMX tiles (CPUs with AMX; the "
        "whole process); off: AVX512-BF16 pair dot products")
    quant_lanes: bool = _env_knob(
        "quant_lanes", "bf16 models on AVX512-BF16 + VBMI CPUs: Q4_0 / Q4_1 blocks that every row count multiplies "
        "in bf16 are regrouped at load (lane-local quants: no byte permute to widen them; the same bits, a faster "
        "single-stream decode); off: the packing every route reads")
    huge_pages: bool = _env_knob(
        "huge_pages", "on cpu: the KV cache and the C++ kernels' packed weights in memory the OS may back with 2 MB "
        "pages (Linux transparent huge pages, madvise mode: fewer TLB misses where a step streams them)")
    int8_activations: bool = _env_knob(
        "int8_activations", "decode-sized matmuls over GGUF blocks read in place (every type: Q4_0 ... Q6_K) "
        "quantize the activations to int8 per 32 (llama.cpp's and vLLM's GGUF numerics: integer dot products, "
        "~2x faster single-stream decode; logits move by about a bf16 rounding and greedy tokens may differ from the "
        "reference's; CPUs with AVX2 (AVX512-VNNI + VBMI kernels where they are: the same bits); not with the "
        "strict mode)")
    fixed_matmuls: bool | None = _env_knob(
        "fixed_matmuls", "every matmul on pagedserve's fixed-order C++ matmul (batch-invariant); default: "
        "on CPUs without AVX-512, where it is the fastest")
    batch_invariant: bool = _env_knob(
        "batch_invariant", "strict mode: a request's logits are bit-identical whatever else is in the batch "
        "(fixed-order C++ matmuls and attention; needs the C++ kernels)")
    keep_dequantized_weights: bool = _env_knob(
        "keep_dequantized_weights", "keep the last GGUF's dequantized weights in memory (many engines in one "
        "process)", cli=False)
    # ---- parallelism (pagedserve/executor/) ----
    tensor_parallel_size: int = _knob(1, "split every layer over this many ranks (processes over "
                                      "torch.distributed: gloo on CPU); each holds its share of the heads, "
                                      "the MLP, the vocabulary and the KV cache")
    tp_local_ranks: int | None = _knob(None, "of the tensor-parallel ranks, how many this machine starts "
                                       "(ranks 0..N-1; default: all). The others join from other machines with "
                                       "`pagedserve worker` and torch.distributed's env:// (MASTER_ADDR, "
                                       "MASTER_PORT)")
    data_parallel_size: int = _knob(1, "independent engine replicas (processes, each with its own threads, "
                                    "KV cache and prefix cache) behind the one API server")
    # ---- speculative decoding ----
    speculative_config: dict | None = _knob(
        None, 'speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 4}; pagedserve adds draft_num_layers, disable_by_batch_size and backoff '
        '(docs/ARCHITECTURE.md)')
    # ---- tracing ----
    keep_block_tables: bool = _knob(False, "record every step's block tables (trace / explain / dashboard)",
                                    cli=False)
    max_step_records: int = _knob(10_000, "step records kept (oldest dropped first)", cli=False)
    max_block_table_records: int | None = _knob(None, "with keep_block_tables, only the newest this many step "
                                                "records keep their block tables (None: all)", cli=False)

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if not isinstance(self.max_step_records, int) or self.max_step_records < 0:
            raise ValueError(f"max_step_records: must be an integer >= 0, got {self.max_step_records!r}")
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.tp_local_ranks is not None and (
                not isinstance(self.tp_local_ranks, int) or not 1 <= self.tp_local_ranks <= self.tensor_parallel_size):
            raise ValueError(f"tp_local_ranks: must be an integer in [1, tensor_parallel_size], got "
                             f"{self.tp_local_ranks!r}")
        for name in ("max_model_len", "num_kv_blocks", "num_threads", "max_block_table_records"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb: must be > 0, got {self.kv_cache_memory_gb!r}")
        canonical_dtype(self.dtype)
        if self.device not in DEVICES:
            raise ValueError(f"device: must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.device == "auto":
            self.device = resolve_device("auto")
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if self.device == "cuda" else "batched"
        if not isinstance(self.gpu_memory_utilization, int | float) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.cuda_graph_sizes is not None:
            sizes = tuple(self.cuda_graph_sizes) if isinstance(self.cuda_graph_sizes, list | tuple) else None
            if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
                raise ValueError(f"cuda_graph_sizes: must be positive batch sizes, got {self.cuda_graph_sizes!r}")
            self.cuda_graph_sizes = tuple(sorted(set(sizes)))
        if self.device == "cuda" and self.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size: tensor parallelism runs on the CPU (gloo) only; on cuda use "
                             "tensor_parallel_size=1")
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision.strip()):
            raise ValueError(f"revision: must be a branch, tag or commit name, got {self.revision!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: unknown backend {self.attention_backend!r} "
                             f"(choose from {sorted(ATTENTION_BACKENDS)})")
        steps = self.num_scheduler_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 64):
            raise ValueError(f"num_scheduler_steps: must be an integer from 1 to 64 (or None), got {steps!r}")
        if self.fixed_matmuls is not None and not isinstance(self.fixed_matmuls, bool):
            raise ValueError(f"fixed_matmuls: must be true, false or None, got {self.fixed_matmuls!r}")
        for f in fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.name}: must be true or false, got {getattr(self, f.name)!r}")
        if self.batch_invariant and (not self.use_cpp_kernels or self.attention_backend != "batched"):
            raise ValueError("batch_invariant: needs the C++ kernels and attention_backend='batched' (its "
                             "fixed-order matmul and attention are C++ kernels)")
        if self.batch_invariant and self.int8_activations:
            raise ValueError("int8_activations: not with batch_invariant (a decode step of up to 4 sequences would "
                             "quantize its activations and a bigger one not, so a request's logits would depend on "
                             "the batch)")
        if self.speculative_config is not None:
            from pagedserve.spec_decode.config import SpeculativeConfig

            self.speculative_config = SpeculativeConfig.from_value(self.speculative_config).to_dict()
        if not isinstance(self.cpu_arch, str) or not self.cpu_arch:
            raise ValueError(f"cpu_arch: must be a -march name, got {self.cpu_arch!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @staticmethod
    def default_of(f: Field):
        """A field's default value (evaluating default factories)."""
        return f.default_factory() if f.default is MISSING else f.default


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'; other names unchanged."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 1024**3


def default_kv_cache_bytes() -> int:
    """A bounded share of free RAM: 20% of what is available, at most 2 GiB."""
    return int(min(available_memory_bytes() * DEFAULT_KV_CACHE_FRACTION, DEFAULT_KV_CACHE_MAX_GB * 1024**3))


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
