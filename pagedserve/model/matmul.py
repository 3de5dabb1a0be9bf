"""Matmul routing: how each weight's matmul runs on this machine, decided once at load, in one place.

A matmul of a few rows (a decode step of 1-4 sequences) is bound by reading the weight once; a matmul
of many rows is a GEMM bound by compute. So each weight gets two routes:

* few rows (<= GEMV_MAX_ROWS): read the GGUF blocks the weight came from (C++ GEMV; exactly the float32
  weights the reference dequantizes: float32 models only), else the C++ bf16 GEMV over the plain
  weight, else as many rows;
* many rows: oneDNN with the weight pre-packed once (bf16 on CPUs with native bf16), else `linear`.

One effective weight per matrix, whatever the batch: every route of a weight multiplies by the same
values. float32: the exact (dequantized) weights on every route. bfloat16: their bf16 rounding on every
route, so the GGUF GEMVs (which widen blocks to the exact float32 weights) serve float32 models only.
The one opt-in exception is `int8_activations` (QUANT_I8): a few rows over Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K
blocks read in place multiply the exact weights by their activations quantized to int8 per 32 (llama.cpp's numerics,
not the reference's), many rows keep the model's route; never in the strict mode. Every AVX2 build has it (the same
bits with AVX512-VNNI + VBMI kernels or AVX2 ones), for the types of CpuKernels.quant_i8_types.

Two special cases:
* the LM head returns float32 logits in every dtype (`float32_out`): a bf16 head runs the fixed-order
  C++ matmul (bf16 weights, float32 sums and output), or float32 `F.linear` over a float32 copy of the
  bf16 weights for many rows on AVX-512 CPUs (where MKL's float32 GEMM is the faster one);
* the fixed-order C++ matmul (csrc/fixed_gemm.cpp: one FMA chain over k per output, so results do not
  depend on the batch) runs every matmul in the strict mode (`batch_invariant`), and by default on CPUs
  without AVX-512 (`CpuKernels.fixed_matmuls`), where it is faster than MKL's float32 GEMM and than
  the emulated bf16 one.

DecodeStack (csrc/decode_stack.cpp) runs the few-rows route it is handed (`MatmulRoutes.decode_spec`);
C++ never chooses. The table of GGUF block layouts below is the Python half of csrc/gguf_layouts.h (a
test checks the two against each other and against gguf-py's block sizes).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from pagedserve.kernels import CpuKernels, cpu_info


@dataclass(frozen=True, slots=True)
class GgufBlockLayout:
    type_id: int  # ggml's type id
    name: str
    block_bytes: int  # 32 weights per block
    quant_offset: int  # first quant byte (the fp16 scale is at byte 0)
    quant_bytes: int
    min_offset: int  # fp16 min, or -1

    @property
    def has_min(self) -> bool:
        return self.min_offset >= 0


GGUF_BLOCK_LAYOUTS: dict[int, GgufBlockLayout] = {
    layout.type_id: layout
    for layout in (
        GgufBlockLayout(2, "Q4_0", 18, 2, 16, -1),
        GgufBlockLayout(3, "Q4_1", 20, 4, 16, 2),
        GgufBlockLayout(8, "Q8_0", 34, 2, 32, -1),
    )
}
GGUF_TYPE_IDS = {layout.name: t for t, layout in GGUF_BLOCK_LAYOUTS.items()}

# Up to this many rows a matmul is a GEMV bound by reading the weight once (DecodeStack's limit too).
GEMV_MAX_ROWS = 4
# Rows above which a bf16 matmul is done in float32 on CPUs without native bf16 math (AVX2 only): there
# the bf16 GEMM is emulated and ~3x slower than float32 once compute-bound, while for a few rows
# (decode of few sequences) it is memory-bound and bf16's halved weight traffic wins ~3x.
BF16_EMULATED_MAX_ROWS = 16


class Route(enum.IntEnum):
    """The values are csrc/decode_stack.cpp's `Route` (checked by a test); PACKED and LINEAR_F32 are Python-only."""

    LINEAR = 0
    BF16_GEMV = 1
    GGUF_ROWS = 2  # GGUF blocks in the file's row layout
    GGUF_R16 = 3  # GGUF blocks regrouped by 16 rows (one vector lane per output row)
    PACKED = 4  # oneDNN, weight pre-packed
    FIXED = 5  # the batch-invariant C++ matmul (csrc/fixed_gemm.cpp) over its packed weight
    LINEAR_F32 = 6  # F.linear in float32 over a float32 copy of a bf16 weight (a bf16 LM head, many rows)
    QUANT = 7  # GGUF quantized blocks read in place at every row count (csrc/quant_gemm.cpp)
    QUANT_BF16 = 8  # the same blocks as bf16 weights against bf16 activations (AVX512-BF16: quant_linear_bf16)
    QUANT_I8 = 9  # few rows: CpuKernels.quant_i8_types' blocks against int8 activations (quant_linear_i8; opt-in)


@dataclass(slots=True)
class QuantTensor:
    """A GGUF weight as read (the loader yields these for block types read in place): ggml type id, uint8
    blocks [rows, row_bytes] (rows in the HF order: llama.cpp's q/k permutation undone), [rows, cols]."""

    type_id: int
    raw: torch.Tensor
    shape: tuple[int, int]


@dataclass(slots=True)
class QuantPart:
    """Rows [n] of a matmul's weight held as GGUF blocks (quant_pack's layout): the weight is exactly the
    float32 matrix gguf-py dequantizes, never widened into memory. A fused matmul whose parts have
    different block types (Gemma's q/k Q5_0 beside v Q8_0) holds one part per run of equal types."""

    type_id: int  # ggml's type id, or that of its lane-local packing (MatmulRoutes._regroup)
    packed: list[torch.Tensor]
    n: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.packed)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except bf16 on a CPU without native bf16 with many rows: upcast, multiply, round back.

    Both routes take bf16 inputs and accumulate in float32, so they agree up to summation order.
    """
    if (
        weight.dtype == torch.bfloat16
        and x.shape[0] > BF16_EMULATED_MAX_ROWS
        and x.device.type == "cpu"
        and not cpu_info().has_native_bf16
    ):
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), b).to(torch.bfloat16)
    return F.linear(x, weight, bias)


def onednn_packing_available() -> bool:
    """oneDNN (mkldnn) can pre-pack bf16 weights for its AMX / AVX512-BF16 matmul kernels."""
    return (
        cpu_info().has_native_bf16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
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


def repack_gguf(type_id: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF blocks [N, K/32 * block_bytes] regrouped by 16 rows for `gemv_gguf_r16`: quants
    [N/16, K/32, j, 16] (the j-th quant byte of 16 rows side by side), fp16 scales and mins
    [N/16, K/32, 16] (mins empty unless Q4_1). No value changes, only the order of the bytes."""
    layout = GGUF_BLOCK_LAYOUTS[type_id]
    n = blocks.shape[0]
    nb = blocks.shape[1] // layout.block_bytes
    b = blocks.view(n, nb, layout.block_bytes)

    def by16(t: torch.Tensor) -> torch.Tensor:  # [N, nb, X] -> [N/16, nb, X, 16]
        return t.reshape(n // 16, 16, nb, t.shape[-1]).permute(0, 2, 3, 1).contiguous()

    def halves(lo: int) -> torch.Tensor:  # fp16 field at byte offset lo of every block -> [N/16, nb, 16]
        return by16(b[:, :, lo : lo + 2].contiguous().view(torch.float16)).reshape(n // 16, nb, 16)

    mins = halves(layout.min_offset) if layout.has_min else torch.empty(0, dtype=torch.float16)
    return by16(b[:, :, layout.quant_offset :]), halves(0), mins


class GgufMatmul:
    """x @ W.T (+ bias) for 1-4 rows of x, W read from its GGUF blocks by the C++ kernels: regrouped by 16
    rows when the row count allows (no horizontal sums), else in GGUF's own row layout."""

    def __init__(self, ext: ModuleType, type_id: int, blocks: torch.Tensor) -> None:
        """ext: the C++ extension (CpuKernels.ext, or kernels.load_extension's module)."""
        self.type_id = type_id
        self.route = Route.GGUF_R16 if blocks.shape[0] % 16 == 0 else Route.GGUF_ROWS
        if self.route == Route.GGUF_R16:
            self.qs, self.scales, self.mins = repack_gguf(type_id, blocks)
            self.fn = ext.gemv_gguf_r16
        else:
            self.blocks = blocks
            self.fn = ext.gemv_gguf

    @property
    def regrouped(self) -> bool:
        return self.route == Route.GGUF_R16

    def tensors(self) -> list[torch.Tensor]:
        """The block tensors DecodeStack's MatmulSpec takes for this route."""
        return [self.qs, self.scales, self.mins] if self.regrouped else [self.blocks]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.regrouped:
            return self.fn(x, self.qs, self.scales, self.mins if self.mins.numel() else None, self.type_id, bias)
        return self.fn(x, self.blocks, self.type_id, bias)


class MatmulRoutes:
    """The routes of one weight's matmul (see the module docstring). Until `setup` runs, every matmul is
    plain `linear` (a float32-out one upcasts its result); the plain weight stays the source of truth
    (embedding lookup, fallbacks)."""

    def __init__(self) -> None:
        self.few_rows = Route.LINEAR
        self.many_rows = Route.LINEAR
        self.packed: torch.Tensor | None = None
        self.gemv = None  # the C++ bf16 GEMV function, on the BF16_GEMV route
        self.qgemv: GgufMatmul | None = None
        self.kernels: CpuKernels | None = None  # for the FIXED route
        self.fixed: torch.Tensor | None = None  # the weight packed for the FIXED route
        self.weight_f32: torch.Tensor | None = None  # for the LINEAR_F32 route
        self.float32_out = False
        # A float32 Q8_0 LM head's column norms for the screened greedy head (CpuKernels.quant_screen_norms).
        self.screen_norms: torch.Tensor | None = None
        # A bf16 Q8_0 LM head's block norms for the int8-screened greedy head (CpuKernels.quant_screen_i8_norms).
        self.screen_i8: torch.Tensor | None = None
        # Set by the loader for GGUF weights read in place (then the module's weight is a meta tensor).
        self.quant: list[QuantPart] | None = None

    def setup(self, weight: torch.Tensor, kernels: CpuKernels | None, *, pack: bool, batch_hint: int,
              qweight: tuple[int, torch.Tensor] | None = None, float32_out: bool = False,
              batch_invariant: bool = False) -> None:
        """Choose both routes. qweight: (ggml type id, uint8 blocks) the weight was dequantized from.
        float32_out: return float32 whatever the weight's dtype (the LM head). batch_invariant: every
        row count on the fixed-order matmul (needs `kernels`)."""
        self.kernels, self.float32_out = kernels, float32_out
        self.packed = self.fixed = self.weight_f32 = self.gemv = self.qgemv = self.screen_norms = self.screen_i8 = None
        if self.quant is not None:  # the blocks, at every row count (batch-invariant by construction)
            if kernels is None:
                raise ValueError("model: quantized weights read in place need the C++ kernels")
            # A bf16 model computes with bf16 weights (the blocks' values rounded, as a dequantized bf16 model
            # holds them), on AVX512-BF16's pair dot products; elsewhere with the exact float32 weights.
            bf16 = weight.dtype == torch.bfloat16 and kernels.quant_bf16
            self.few_rows = self.many_rows = Route.QUANT_BF16 if bf16 else Route.QUANT
            if float32_out and not bf16 and len(self.quant) == 1:
                p = self.quant[0]
                norms = kernels.quant_screen_norms(p.packed, p.type_id, p.n, weight.shape[1])
                self.screen_norms = norms if norms.numel() else None  # (a Q8_0 head with finite scales)
            if float32_out and bf16 and len(self.quant) == 1 and kernels.screened_head:
                p = self.quant[0]
                norms = kernels.quant_screen_i8_norms(p.packed, p.type_id, p.n, weight.shape[1])
                self.screen_i8 = norms if norms.numel() else None
            # Opted in (EngineConfig.int8_activations): a few rows quantize their activations, llama.cpp's way.
            # (Every part's type must be one the build takes: CpuKernels.quant_i8_types.)
            ggml_types = [kernels.ggml_type(p.type_id) for p in self.quant]  # (a lane-local part: its ggml type)
            if kernels.quant_i8 and not batch_invariant and all(t in kernels.quant_i8_types for t in ggml_types):
                self.few_rows = Route.QUANT_I8
            self._regroup(kernels, lanes=self.few_rows == self.many_rows == Route.QUANT_BF16 and not float32_out)
            return
        bf16 = weight.dtype == torch.bfloat16
        if batch_invariant and kernels is None:
            raise ValueError("batch_invariant: needs the C++ kernels (they could not be built or are off)")
        if batch_invariant or (kernels is not None and kernels.fixed_matmuls):
            self.fixed = kernels.resident(kernels.fixed_pack(weight.detach()))
            self.few_rows = self.many_rows = Route.FIXED
            return
        if float32_out and bf16:
            # float32 logits from bf16 weights: float32 sums all the way, never a bf16 rounding.
            if kernels is not None:
                self.fixed = kernels.resident(kernels.fixed_pack(weight.detach()))
            many_fixed = kernels is not None and not cpu_info().has_avx512
            if not many_fixed:
                self.weight_f32 = weight.detach().float()
            self.few_rows = Route.FIXED if kernels is not None else Route.LINEAR_F32
            self.many_rows = Route.FIXED if many_fixed else Route.LINEAR_F32
            return
        self.packed = pack_weight(weight, batch_hint) if pack else None
        self.many_rows = Route.PACKED if self.packed is not None else Route.LINEAR
        # The GGUF GEMVs compute with the exact float32 weights: only where every other route does too.
        usable = (qweight is not None and kernels is not None and qweight[0] in kernels.gguf_block_types
                  and weight.dtype == torch.float32)
        self.qgemv = GgufMatmul(kernels.ext, *qweight) if usable else None
        bf16_cpu = bf16 and weight.device.type == "cpu"
        self.gemv = kernels.ext.gemv_bf16 if bf16_cpu and kernels is not None and kernels.bf16_gemv else None
        if self.qgemv is not None:
            self.few_rows = self.qgemv.route
        elif self.gemv is not None:
            self.few_rows = Route.BF16_GEMV
        else:
            self.few_rows = self.many_rows

    def _regroup(self, kernels: CpuKernels, lanes: bool) -> None:
        """Each part's blocks in place in the lane-local packing where `lanes` (only quant_linear_bf16 reads this
        weight: the LM head, whose blocks a tied embedding also reads, never is) and the build has one for its type
        (CpuKernels.lanes_type: Q4_0, Q4_1), else in quant_pack's (a second setup may go either way); the part's
        type_id names its packing."""
        for p in self.quant or []:
            ggml = kernels.ggml_type(p.type_id)
            want = (kernels.lanes_type(ggml) if lanes else None) or ggml
            if want != p.type_id:
                kernels.relayout(p.packed, p.type_id, want)
                p.type_id = want

    def route_for(self, x: torch.Tensor) -> Route:
        """The route x's row count takes (few_rows for 1 to GEMV_MAX_ROWS rows, else many_rows)."""
        return self.route_for_rows(x.shape[0])

    def route_for_rows(self, rows: int) -> Route:
        return self.few_rows if 0 < rows <= GEMV_MAX_ROWS else self.many_rows

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        route = self.route_for(x)
        if route in (Route.QUANT, Route.QUANT_BF16, Route.QUANT_I8):
            return self._quant(x, bias, route)
        if route == Route.FIXED:
            out_dtype = torch.float32 if self.float32_out else x.dtype
            return self.kernels.fixed_linear(x, self.fixed, weight.shape[0], bias, out_dtype)
        if route == Route.LINEAR_F32:
            return F.linear(x.float(), self.weight_f32, None if bias is None else bias.float())
        if route == Route.LINEAR:
            y = linear(x, weight, bias)
        elif route == Route.PACKED:
            y = packed_linear(x, self.packed, bias)
        elif route == Route.BF16_GEMV:
            y = self.gemv(x, weight, bias)
        else:
            y = self.qgemv(x, bias)
        # A float32 weight gives float32 sums and output already; setup never leaves a bf16 weight here
        # with float32_out (only plain, never-set-up routes reach this with bf16 and upcast).
        return y.float() if self.float32_out else y

    def _quant(self, x: torch.Tensor, bias: torch.Tensor | None, route: Route = Route.QUANT) -> torch.Tensor:
        out_dtype = torch.float32 if self.float32_out else x.dtype
        k = self.kernels
        if route == Route.QUANT_BF16:
            fn, x = k.quant_linear_bf16, x.to(torch.bfloat16)
        else:
            fn = k.quant_linear_i8 if route == Route.QUANT_I8 else k.quant_linear
        if len(self.quant) == 1:
            p = self.quant[0]
            return fn(x, p.packed, p.type_id, p.n, bias, out_dtype)
        outs, start = [], 0
        for p in self.quant:
            b = None if bias is None else bias[start : start + p.n]
            outs.append(fn(x, p.packed, p.type_id, p.n, b, out_dtype))
            start += p.n
        return torch.cat(outs, dim=-1)

    def argmax(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """Greedy decoding over this float32-out matmul (an LM head): int64 [rows], each row's first argmax of the
        logits `self(x, ...)` gives (-1 where one is NaN), without writing them; on the QUANT_BF16 route with a single
        block type (and CpuKernels.greedy_head; a Q8_0 head there with the int8 screen of screen_i8 above the few rows,
        without bias or AMX), and on the QUANT route for more than GEMV_MAX_ROWS rows of a Q8_0 head without bias (the
        screened head: CpuKernels.quant_linear_argmax); None elsewhere."""
        route = self.route_for(x)
        if route == Route.QUANT and self.screen_norms is not None and bias is None and x.shape[0] > GEMV_MAX_ROWS:
            # (1-4 rows: the GEMV's logits then argmax_rows are faster; bf16 x: quant_linear computes in float32 too)
            p = self.quant[0]
            x = x.float()
            if x.stride(-1) != 1:
                x = x.contiguous()
            return self.kernels.quant_linear_argmax(x, p.packed, p.type_id, p.n, self.screen_norms)
        p = self.bf16_argmax_part(x.shape[0])
        if p is None:
            return None
        return self.kernels.quant_linear_bf16_argmax(x.to(torch.bfloat16), p.packed, p.type_id, p.n, bias,
                                                     self.screen_i8)

    def bf16_argmax_part(self, rows: int):
        """The GGUF blocks whose fused bf16 argmax (CpuKernels.quant_linear_bf16_argmax) argmax() runs for this many
        rows: the QUANT_BF16 route, a single block type, float32 logits, the build's greedy head; else None."""
        if (self.route_for_rows(rows) != Route.QUANT_BF16 or not self.float32_out or len(self.quant) != 1
                or not self.kernels.greedy_head):
            return None
        return self.quant[0]

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this [gate; up] matmul (no bias) in one kernel call, the same bits as the matmul then
        kernels.silu_and_mul: on the QUANT_BF16 route with bf16 x, or the QUANT route with float32 x, and a single
        block type; None elsewhere."""
        route = self.route_for(x)
        bf16 = route == Route.QUANT_BF16 and x.dtype == torch.bfloat16
        if not (bf16 or (route == Route.QUANT and x.dtype == torch.float32)):
            return None
        if self.float32_out or len(self.quant) != 1 or self.quant[0].n % 32:
            return None
        p = self.quant[0]
        fused = self.kernels.quant_linear_bf16_silu if bf16 else self.kernels.quant_linear_silu
        return fused(x, p.packed, p.type_id, p.n)

    @property
    def one_route(self) -> bool:
        """This matmul runs one C++ route at every row count (the GGUF blocks' or the fixed-order route), so
        DecodeStack computes what the layer-by-layer path does for any number of rows, not only a few."""
        return self.few_rows == self.many_rows and self.few_rows in (Route.QUANT, Route.QUANT_BF16, Route.FIXED)

    def decode_spec(self, kernels: CpuKernels, weight: torch.Tensor, bias: torch.Tensor | None):
        """This matmul's few-rows route as DecodeStack's MatmulSpec (PACKED runs as LINEAR there: the
        packed matmul gives F.linear's numbers). A quantized weight of several parts (block types) is one spec
        whose `more` holds the later parts, concatenated in C++ as `_quant` concatenates them."""
        if self.float32_out:
            raise ValueError("decode_spec: a float32-out matmul (the LM head) is not part of DecodeStack")
        route = Route.LINEAR if self.few_rows == Route.PACKED else self.few_rows
        if route in (Route.QUANT, Route.QUANT_BF16, Route.QUANT_I8):
            specs, start = [], 0
            for p in self.quant:
                b = bias if bias is None or len(self.quant) == 1 else bias[start : start + p.n].contiguous()
                specs.append((int(route), None, b, list(p.packed), p.type_id, p.n))
                start += p.n
            rest = [kernels.ext.MatmulSpec(*spec) for spec in specs[1:]]
            return kernels.ext.MatmulSpec(*specs[0], more=rest)
        if route == Route.FIXED:
            return kernels.ext.MatmulSpec(int(route), weight, bias, [self.fixed], 0)
        q = self.qgemv.tensors() if self.qgemv is not None else []
        qtype = self.qgemv.type_id if self.qgemv is not None else 0
        return kernels.ext.MatmulSpec(int(route), weight, bias, q, qtype)
