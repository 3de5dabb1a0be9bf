"""The one owner of pagedserve's C++ CPU kernels.

`CpuKernels.from_config(config)` builds (or loads) the extension once and says, in typed fields, what
this engine may use: the fused elementwise ops, the paged decode attention and the batch-invariant
matmul (every build), the bf16
GEMV (AVX512-BF16 builds), the GEMVs over GGUF blocks (AVX-512 builds), the matmuls and embedding lookup
over GGUF blocks read in place (every build) and DecodeStack, each also
switched by the engine config. The model runner hands the one object to the model, the attention
backend and the sampler; None means "no C++ at all" (pure PyTorch).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from pagedserve.kernels import huge_pages
from pagedserve.kernels.build import load_extension
from pagedserve.kernels.cpu_info import CpuInfo, cpu_info

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig

logger = logging.getLogger(__name__)

__all__ = ["CpuInfo", "CpuKernels", "cpu_info", "load_extension"]


@dataclass(frozen=True, slots=True)
class CpuKernels:
    ext: ModuleType  # the compiled extension (its functions are listed in csrc/bindings.cpp)
    arch: str  # the -march it was built for
    has_avx512: bool
    bf16_gemv: bool  # gemv_bf16 for 1-4 rows of bf16 (built with AVX512-BF16, and enabled)
    gguf_gemv: bool  # gemv_gguf / gemv_gguf_r16 over Q4_0/Q4_1/Q8_0 blocks (AVX-512, and enabled)
    gguf_block_types: frozenset[int]  # ggml type ids the GGUF GEMVs read (empty when gguf_gemv is off)
    decode_stack: bool  # DecodeStack: every layer of a decode step in one call (few sequences, or any on one route)
    # Every matmul on the fixed-order C++ matmul (batch-invariant by construction). Default: on CPUs
    # without AVX-512, where it is also faster than the library GEMMs (benchmarks/README.md).
    fixed_matmuls: bool = False
    # ggml type ids whose GGUF blocks quant_linear / quant_embedding read in place (every build).
    quant_types: frozenset[int] = frozenset()
    # quant_linear_bf16: bf16 activations against the blocks' weights rounded to bf16 (AVX512-BF16 builds).
    quant_bf16: bool = False
    # quant_linear_bf16_argmax: greedy decoding's head without its logits (with quant_bf16; an extension built from
    # an older commit, as benchmarks/ab_builds.py may load, lacks it and the head writes logits as before).
    greedy_head: bool = False
    # quant_screen_i8_norms: the bf16 greedy head's int8 screen above the few rows (AVX512-VNNI + BF16 builds without
    # AMX; an older extension lacks it and the head runs every exact chain).
    screened_head: bool = False
    # quant_linear_i8 for 1-4 rows over GGUF blocks: activations quantized to int8 per 32 (llama.cpp's numerics; built
    # with AVX2 -- AVX512-VNNI + VBMI kernels or AVX2 ones, the same bits -- and asked for:
    # EngineConfig.int8_activations), for the ggml types of quant_i8_types (every type read in place:
    # Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K).
    quant_i8: bool = False
    quant_i8_types: frozenset[int] = frozenset()
    # The bf16 route's lane-local packing of Q4_0 / Q4_1 (quant_lanes_type, quant_relayout: AVX512-BF16 + VBMI builds;
    # EngineConfig.quant_lanes): a weight whose every row count runs quant_linear_bf16 is regrouped at load so that
    # the widening needs no lane-crossing byte permute.
    quant_lanes: bool = False
    # Where the model keeps its packed weights (`resident`): an arena of memory the OS may back with 2 MB pages
    # (huge_pages.py; EngineConfig.huge_pages), else None (as packed).
    arena: huge_pages.Arena | None = None

    @classmethod
    def build(cls, arch: str = "native", *, bf16_gemv: bool = True, gguf_gemv: bool = True,
              decode_stack: bool = True, fixed_matmuls: bool | None = None,
              amx: bool = True, int8_activations: bool = False, use_huge_pages: bool = False,
              quant_lanes: bool = True) -> CpuKernels | None:
        ext = load_extension(arch)
        if ext is None:
            return None
        ext.set_amx(amx)  # process-wide: see `amx_active`
        gguf = gguf_gemv and ext.has_gguf_gemv()
        return cls(
            ext=ext,
            arch=arch,
            has_avx512=ext.has_avx512(),
            bf16_gemv=bf16_gemv and ext.has_bf16_gemv(),
            gguf_gemv=gguf,
            gguf_block_types=frozenset(t for t, *_ in ext.gguf_block_layouts()) if gguf else frozenset(),
            decode_stack=decode_stack,
            fixed_matmuls=(not ext.has_avx512()) if fixed_matmuls is None else fixed_matmuls,
            quant_types=frozenset(ext.quant_types()),
            quant_bf16=ext.has_quant_bf16(),
            greedy_head=ext.has_quant_bf16() and hasattr(ext, "quant_linear_bf16_argmax"),
            screened_head=ext.has_quant_bf16() and hasattr(ext, "quant_screen_i8_norms"),
            quant_i8=int8_activations and ext.has_quant_i8(),
            quant_i8_types=frozenset(ext.quant_i8_types()),
            quant_lanes=quant_lanes and hasattr(ext, "quant_lanes_type"),
            arena=huge_pages.Arena() if use_huge_pages else None,
        )

    @classmethod
    def from_config(cls, config: EngineConfig) -> CpuKernels | None:
        """What an engine of this config uses on the CPU; None without C++ (switched off, the reference
        attention backend, another device, or no compiler)."""
        if not config.use_cpp_kernels or config.attention_backend == "torch_ref" or config.device != "cpu":
            return None
        kernels = cls.build(config.cpu_arch, bf16_gemv=config.bf16_gemv, gguf_gemv=config.gguf_gemv,
                            decode_stack=config.decode_stack, fixed_matmuls=config.fixed_matmuls,
                            amx=config.amx, int8_activations=config.int8_activations,
                            use_huge_pages=config.huge_pages, quant_lanes=config.quant_lanes)
        if kernels is not None and config.int8_activations and not kernels.quant_i8:
            logger.warning("int8_activations: this CPU (or build) has no AVX2 + FMA + F16C; decode matmuls keep the "
                           "model's activations (bf16 / float32)")
        return kernels

    @property
    def amx_active(self) -> bool:
        """quant_linear_bf16 and the bf16 prefill rows run on AMX tiles in this process (AMX CPUs, switched on,
        granted by the OS; other bits than the vdpbf16ps routes, so one route serves every row count). The switch
        is the process's, set by the last `build`."""
        return self.ext.amx_active()

    def resident(self, packed):
        """A packed weight (a tensor or quant_pack's list) as the model keeps it: copied into the arena, or as is."""
        if self.arena is None:
            return packed
        return [self.arena.copy(t) for t in packed] if isinstance(packed, list) else self.arena.copy(packed)

    def replace(self, **changes: Any) -> CpuKernels:
        """A copy with some capabilities switched off (tests and benchmarks compare paths this way)."""
        return dataclasses.replace(self, **changes)

    # ---- the fused ops every build has (thin, typed entry points) -----------------------------------
    def rms_norm(self, x, weight, eps: float, once: bool = False):
        """once: Gemma's rounding (x_hat * w in float32, rounded once); else Llama's (x_hat rounded, then * w)."""
        return self.ext.rms_norm(x, weight, eps, once)

    def fused_add_rms_norm(self, x, residual, weight, eps: float, once: bool = False) -> None:
        self.ext.fused_add_rms_norm(x, residual, weight, eps, once)

    def rms_norm_heads(self, qkv, q_weight, k_weight, num_heads: int, num_kv_heads: int, eps: float,
                       once: bool) -> None:
        """RMSNorm of each q head (q_weight) and k head (k_weight) inside qkv's rows, in place (Qwen3, Gemma 3)."""
        self.ext.rms_norm_heads(qkv, q_weight, k_weight, num_heads, num_kv_heads, eps, once)

    def rotary_write_kv(self, qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads: int,
                        num_kv_heads: int) -> None:
        self.ext.rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)

    def silu_and_mul(self, gate_up):
        return self.ext.silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up):
        """GeGLU: gelu(gate) with the tanh approximation, rounded to the dtype, times up."""
        return self.ext.gelu_tanh_and_mul(gate_up)

    def argmax_rows(self, logits):
        """int64 [R]: each row's first argmax of float32 or bf16 logits [R, V] (contiguous rows), -1 where one is
        NaN."""
        return self.ext.argmax_rows(logits)

    def sample_rows(self, probs, u):
        """One draw per row of non-negative float32 weights [R, V] by the inverse CDF, u float64 [R] in [0, 1)."""
        return self.ext.sample_rows(probs, u)

    def sample_logits(self, logits, temperature, top_k, top_p, min_p, u):
        """The sampler's whole draw per row of float32 logits [R, V]: temperature [R] (0: the argmax), top_k [R] int64
        (0: off), top_p and min_p [R] float32, u float64 [R] in [0, 1) -> int64 [R] (-1 for a row that cannot draw)."""
        return self.ext.sample_logits(logits, temperature, top_k, top_p, min_p, u)

    def filtered_weights(self, logits, temperature, top_k, top_p, min_p):
        """The [R, V] float32 weights sample_logits draws from (unnormalised, each row's largest kept one 1; one-hot
        at the argmax where the temperature is 0, NaN for a row that cannot draw)."""
        return self.ext.filtered_weights(logits, temperature, top_k, top_p, min_p)

    def logprobs_rows(self, logits, rows, tokens, k):
        """Log-softmax logprobs of rows [n] of float32 logits [R, V]: (chosen [n], rank [n], top ids [n, k], top
        logprobs [n, k]) for the sampled tokens [n]; the top k largest first, ties in index order."""
        return self.ext.logprobs_rows(logits, rows, tokens, k)

    def apply_token_bitmask(self, logits, bitmask, rows) -> None:
        """Structured outputs: logits[rows[i], t] = -inf where bit t of bitmask[i] is clear (in place)."""
        self.ext.apply_token_bitmask(logits, bitmask, rows)

    def paged_decode_attention(self, q, k_cache, v_cache, block_tables, seq_lens, rows, out, scale: float,
                               window: int | None = None) -> None:
        """window: a sliding window (each sequence's last `window` keys); None: every key."""
        self.ext.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, rows, out, scale, window or 0)

    def paged_attention_rows(self, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale: float,
                             window: int | None = None):
        """Every query row over its own context in a per-row fixed order (prefill chunks; the strict mode's every
        row). window: a sliding window (each row's last `window` positions, itself included); None: every key."""
        return self.ext.paged_attention_rows(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                             window or 0)

    def paged_attention_rows_into(self, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, rows, out,
                                  scale: float, window: int | None = None) -> None:
        """paged_attention_rows over the rows q[rows] (query_start_loc indexes rows), written to out[rows] in place."""
        self.ext.paged_attention_rows_into(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, rows, out,
                                           scale, window or 0)

    # ---- the batch-invariant matmul (csrc/fixed_gemm.cpp; every build) -----------------------------
    def fixed_pack(self, weight):
        """[N, K] float32/bf16 -> the packed layout fixed_linear reads ([ceil(N/16), K, 16])."""
        return self.ext.fixed_pack(weight)

    def fixed_linear(self, x, packed, n: int, bias, out_dtype):
        """x @ w.T (+ bias) with one float32 FMA chain over k per output: a row's result is the same bits
        whatever else is in the batch."""
        return self.ext.fixed_linear(x, packed, n, bias, out_dtype)

    # ---- GGUF quantized weights read in place (csrc/quant_gemm.cpp; every build) -------------------
    def quant_pack(self, raw, type_id: int) -> list:
        """GGUF blocks uint8 [N, row_bytes] of a type in `quant_types` -> the packed list quant_linear and
        quant_embedding read: [uint8 [ceil(N/16), 16 * row_bytes]], the file's bytes regrouped by 16 rows
        (no expansion; the only overhead is the zero rows padding N to a multiple of 16)."""
        return self.ext.quant_pack(raw, type_id)

    def lanes_type(self, type_id: int) -> int | None:
        """The type id of ggml type type_id's lane-local packing, where this build's bf16 route reads it and
        `quant_lanes` is on (Q4_0, Q4_1 with AVX512-BF16 and VBMI), else None."""
        if not self.quant_lanes:
            return None
        lanes = self.ext.quant_lanes_type(type_id)
        return lanes if lanes >= 0 else None

    def ggml_type(self, type_id: int) -> int:
        """The ggml type of a packing's type id (a lane-local packing's, or a ggml type's own)."""
        if type_id in self.quant_types or not hasattr(self.ext, "quant_lanes_type"):
            return type_id
        return next((t for t in self.quant_types if self.ext.quant_lanes_type(t) == type_id), type_id)

    def relayout(self, packed, from_type: int, to_type: int) -> None:
        """Regroup quant_pack's blocks in place between a ggml type's packing and its lane-local one."""
        self.ext.quant_relayout(packed, from_type, to_type)

    def quant_linear(self, x, packed, type_id: int, n: int, bias, out_dtype):
        """x [M, K] (float32/bf16) @ W.T (+ bias), W the [n, K] float32 matrix gguf-py dequantizes: the same
        bits as fixed_linear over that W, at every M and thread count (batch-invariant)."""
        return self.ext.quant_linear(x, packed, type_id, n, x.shape[-1], bias, out_dtype)

    def quant_linear_bf16(self, x, packed, type_id: int, n: int, bias, out_dtype):
        """bf16 x [M, K] @ Wb.T (+ bias), Wb the dequantized weight rounded to bf16 (as a bf16 model holds it):
        one AVX512-BF16 pair-dot chain (AMX: one TDPBF16PS chain, see `amx_active`) per output, the same bits
        whatever M (needs `quant_bf16`)."""
        return self.ext.quant_linear_bf16(x, packed, type_id, n, x.shape[-1], bias, out_dtype)

    def quant_linear_bf16_argmax(self, x, packed, type_id: int, n: int, bias, screen=None):
        """Greedy decoding over an LM head: int64 [M], each row's first argmax of quant_linear_bf16's float32 logits
        (-1 where one is NaN), the logits never written where the many-rows kernels run (needs `quant_bf16`); with
        screen (quant_screen_i8_norms of this weight), above the few rows and without bias or AMX, an int8 screen
        rules out the columns that cannot hold a row's maximum first: the same indices."""
        if screen is None:
            return self.ext.quant_linear_bf16_argmax(x, packed, type_id, n, x.shape[-1], bias)
        return self.ext.quant_linear_bf16_argmax(x, packed, type_id, n, x.shape[-1], bias, screen)

    def quant_screen_i8_norms(self, packed, type_id: int, n: int, k: int):
        """float32: a Q8_0 weight's per-block column sums of |w| (rounded up) and each panel's largest, what
        quant_linear_bf16_argmax's screen bounds its logits with; an empty tensor where the weight (another type, a
        non-finite scale) or the build (no AVX512-VNNI + BF16) cannot be screened (needs `screened_head`)."""
        return self.ext.quant_screen_i8_norms(packed, type_id, n, k)

    def quant_screen_norms(self, packed, type_id: int, n: int, k: int):
        """float32 [ceil(n / 16) * 16]: each column's sum of |w| over a Q8_0 weight (rounded up, zeros past n), what
        quant_linear_argmax bounds its screen with; an empty tensor where the weight (another type, a non-finite
        scale) or the build (no AVX2 + FMA + F16C) cannot be screened."""
        return self.ext.quant_screen_norms(packed, type_id, n, k)

    def quant_linear_argmax(self, x, packed, type_id: int, n: int, norms):
        """Greedy decoding over a float32 Q8_0 LM head without bias: int64 [M], each row's first argmax of
        quant_linear's float32 logits (-1 where one is NaN), never writing them: an int16 screen bounds every logit
        (a rigorous bound per row and column), and only the columns that can hold a row's maximum get their exact
        FMA chain (norms: quant_screen_norms of this weight, non-empty)."""
        return self.ext.quant_linear_argmax(x, packed, type_id, n, x.shape[-1], norms)

    def quant_linear_silu(self, x, packed, type_id: int, n: int):
        """silu(gate) * up of quant_linear (float32 x and out) over W = [gate; up] (n = 2 I, I % 16 == 0, no bias):
        the bits of silu_and_mul over it, in one call (fused where the AVX2 kernels are built: the [M, 2 I] product
        is never written)."""
        return self.ext.quant_linear_silu(x, packed, type_id, n, x.shape[-1])

    def quant_linear_bf16_silu(self, x, packed, type_id: int, n: int):
        """silu(gate) * up of quant_linear_bf16 (bf16 out) over W = [gate; up] (n = 2 I, I % 16 == 0, no bias): the
        bits of silu_and_mul over it, in one call (fused where AMX runs the many-rows matmul)."""
        return self.ext.quant_linear_bf16_silu(x, packed, type_id, n, x.shape[-1])

    def quant_linear_i8(self, x, packed, type_id: int, n: int, bias, out_dtype):
        """W . Q(x) (+ bias) for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K blocks: x's rows (float32/bf16) quantized to
        int8 per 32-k block (dx = max|x| / 127, nearest-even), integer dot products against the quants, exact, then
        one float32 chain per output over the blocks: llama.cpp's activations, not the reference's result (needs
        `quant_i8`'s build and a type of `quant_i8_types`; the same bits for a row whatever M, and on AVX2 as with
        AVX512-VNNI)."""
        return self.ext.quant_linear_i8(x, packed, type_id, n, x.shape[-1], bias, out_dtype)

    def quant_embedding(self, ids, packed, type_id: int, k: int, out_dtype):
        """Rows `ids` (int64, any shape) of the dequantized [N, k] weight -> [*ids.shape, k] in out_dtype."""
        return self.ext.quant_embedding(ids, packed, type_id, k, out_dtype)
