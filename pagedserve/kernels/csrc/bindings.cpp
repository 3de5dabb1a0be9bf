// Python bindings of pagedserve's CPU kernels (built at first use by pagedserve/kernels/build.py).
#include <string>
#include <tuple>
#include <vector>

#include "gguf_layouts.h"
#include "ops.h"

namespace pagedserve {
void bind_decode_stack(pybind11::module& m);
}  // namespace pagedserve

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  pagedserve::bind_decode_stack(m);
  m.def("paged_decode_attention", &pagedserve::paged_decode_attention,
        "decode attention over a paged KV cache, written into out's rows (window > 0: each sequence's last `window` "
        "keys only)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("rows"), py::arg("out"), py::arg("scale"), py::arg("window") = 0);
  m.def("paged_attention_rows", &pagedserve::paged_attention_rows,
        "every query row over its own context, in an order fixed per row (window > 0: its last `window` positions)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("scale"), py::arg("window") = 0);
  m.def("paged_attention_rows_into", &pagedserve::paged_attention_rows_into,
        "paged_attention_rows over the rows q[rows], written into out's rows",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("rows"), py::arg("out"), py::arg("scale"), py::arg("window") = 0);
  m.def("rms_norm", &pagedserve::rms_norm, py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("once") = false,
        "RMSNorm of [T, H] rows (once: Gemma's single rounding after the weight)");
  m.def("fused_add_rms_norm", &pagedserve::fused_add_rms_norm, py::arg("x"), py::arg("residual"), py::arg("w"),
        py::arg("eps"), py::arg("once") = false, "residual += x; x = rms_norm(residual), in place");
  m.def("rms_norm_heads", &pagedserve::rms_norm_heads, py::arg("qkv"), py::arg("q_w"), py::arg("k_w"), py::arg("h"),
        py::arg("kvh"), py::arg("eps"), py::arg("once"), "RMSNorm of each q and k head inside qkv rows, in place");
  m.def("rotary_write_kv", &pagedserve::rotary_write_kv, "rotary on q/k in place + K/V into the paged cache");
  m.def("silu_and_mul", &pagedserve::silu_and_mul, "SwiGLU: silu(gate) * up");
  m.def("gelu_tanh_and_mul", &pagedserve::gelu_tanh_and_mul, "GeGLU: gelu_tanh(gate) * up");
  m.def("argmax_rows", &pagedserve::argmax_rows,
        "int64 [R]: each row's first argmax (greedy sampling), -1 where one is NaN");
  m.def("sample_rows", &pagedserve::sample_rows, "one inverse-CDF draw per row of non-negative weights (u: [R] in [0, 1))");
  m.def("sample_logits", &pagedserve::sample_logits, "the sampler's draw per row from logits: temperature (0: argmax), top-k, top-p, min-p, inverse CDF");
  m.def("filtered_weights", &pagedserve::filtered_weights, "the weights sample_logits draws from, [R, V] (largest kept: 1)");
  m.def("logprobs_rows", &pagedserve::logprobs_rows, "logprobs of the chosen tokens, their ranks and the top k per row (log-softmax)");
  m.def("apply_token_bitmask", &pagedserve::apply_token_bitmask,
        "structured outputs: -inf on the logits whose bit is clear in a row's token bitmask, in place");
  m.def("has_bf16_gemv", &pagedserve::has_bf16_gemv, "whether gemv_bf16 is built (AVX512-BF16)");
  m.def("gemv_bf16", &pagedserve::gemv_bf16, "x @ w.T (+ bias) for 1-4 rows of bf16, memory-bound");
  m.def("has_gguf_gemv", &pagedserve::has_gguf_gemv, "whether gemv_gguf is built (AVX-512)");
  m.def("gemv_gguf", &pagedserve::gemv_gguf, "x @ w.T (+ bias) for 1-4 rows, w read from GGUF Q4_0/Q4_1/Q8_0 blocks");
  m.def("gemv_gguf_r16", &pagedserve::gemv_gguf_r16,
        "x @ w.T (+ bias) for 1-4 rows, w in GGUF blocks regrouped by 16 rows (model/matmul.py: repack_gguf)");
  m.def("fixed_pack", &pagedserve::fixed_pack, "pack [N, K] for fixed_linear: [ceil(N/16), K, 16]");
  m.def("fixed_linear", &pagedserve::fixed_linear, py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias"),
        py::arg("out_dtype"), "batch-invariant x @ w.T (+ bias): one FMA chain over k per output");
  m.def("quant_types", &pagedserve::quant_types,
        "the ggml type ids quant_pack / quant_linear / quant_embedding read (Q4_0 ... Q6_K)");
  m.def("quant_pack", &pagedserve::quant_pack, py::arg("raw"), py::arg("type_id"),
        "GGUF rows of blocks uint8 [N, row_bytes] -> [packed] (16 rows per panel, bytes regrouped, not expanded)");
  m.def("quant_lanes_type", &pagedserve::quant_lanes_type, py::arg("type_id"),
        "the type id of the lane-local packing of a ggml type that this build's bf16 route reads (Q4_0, Q4_1 with "
        "AVX512-BF16 and VBMI), else -1");
  m.def("quant_relayout", &pagedserve::quant_relayout, py::arg("packed"), py::arg("from_type"), py::arg("to_type"),
        "regroup quant_pack's blocks in place between a ggml type's packing and its lane-local one (either way)");
  m.def("quant_linear", &pagedserve::quant_linear, py::arg("x"), py::arg("packed"), py::arg("type_id"), py::arg("n"),
        py::arg("k"), py::arg("bias"), py::arg("out_dtype"),
        "x @ W.T (+ bias), W read from quant_pack's blocks: fixed_linear's FMA chains over the dequantized W");
  m.def("has_quant_bf16", &pagedserve::has_quant_bf16, "whether quant_linear_bf16 is built (AVX512-BF16)");
  m.def("has_amx", &pagedserve::has_amx, "whether the AMX routes are built (quant_linear_bf16, bf16 prefill rows)");
  m.def("amx_active", &pagedserve::amx_active,
        "whether quant_linear_bf16 and the bf16 prefill row attention run on AMX tiles in this process (built, on, "
        "and granted by the OS)");
  m.def("set_decode_team", &pagedserve::set_decode_team, py::arg("enabled"),
        "run DecodeStack's steps of few sequences as one team (one parallel region per step; default on) or with a "
        "parallel region per op (the same bits); returns the previous setting");
  m.def("decode_team_steps", &pagedserve::decode_team_steps, "how many DecodeStack steps have run as a team");
  m.def("claim_ranges_trace", &pagedserve::claim_ranges_trace, py::arg("n"), py::arg("threads"), py::arg("slow"),
        py::arg("slow_us"),
        "claim_for's split of [0, n) on `threads` threads, thread `slow` sleeping slow_us per item: the (thread, begin, "
        "end) ranges each took (a test of the claims)");
  m.def("set_amx", &pagedserve::set_amx, py::arg("enabled"),
        "switch the AMX routes on/off for this process; returns amx_active()");
  m.def("quant_linear_bf16", &pagedserve::quant_linear_bf16, py::arg("x"), py::arg("packed"), py::arg("type_id"),
        py::arg("n"), py::arg("k"), py::arg("bias"), py::arg("out_dtype"),
        "bf16 x @ Wb.T (+ bias), Wb quant_pack's blocks dequantized and rounded to bf16: one vdpbf16ps (or, where AMX is active, one TDPBF16PS) chain per output");
  m.def("quant_linear_bf16_argmax", &pagedserve::quant_linear_bf16_argmax, py::arg("x"), py::arg("packed"),
        py::arg("type_id"), py::arg("n"), py::arg("k"), py::arg("bias"), py::arg("screen") = py::none(),
        "int64 [M]: each row's first argmax of quant_linear_bf16's float32 logits (-1 where one is NaN), the many-rows "
        "routes never writing the logits (greedy decoding's LM head); screen: quant_screen_i8_norms of the weight (the "
        "int8 screen above the few rows, where it applies)");
  m.def("quant_screen_i8_norms", &pagedserve::quant_screen_i8_norms, py::arg("packed"), py::arg("type_id"),
        py::arg("n"), py::arg("k"),
        "float32: a Q8_0 weight's per-block column sums of |w| (and each panel's largest) for quant_linear_bf16_argmax's "
        "screen; empty where it cannot be screened");
  m.def("quant_screen_norms", &pagedserve::quant_screen_norms, py::arg("packed"), py::arg("type_id"), py::arg("n"),
        py::arg("k"),
        "float32 [ceil(n / 16) * 16]: each column's sum of |w| over a Q8_0 weight, rounded up, for quant_linear_argmax "
        "(empty: this weight or build cannot be screened)");
  m.def("quant_linear_argmax", &pagedserve::quant_linear_argmax, py::arg("x"), py::arg("packed"), py::arg("type_id"),
        py::arg("n"), py::arg("k"), py::arg("norms"),
        "int64 [M]: each row's first argmax of quant_linear's float32 logits over a Q8_0 LM head (-1 where one is NaN), "
        "from an int16 screen with a rigorous bound and the exact chains of the few columns it leaves");
  m.def("quant_linear_silu", &pagedserve::quant_linear_silu, py::arg("x"), py::arg("packed"), py::arg("type_id"),
        py::arg("n"), py::arg("k"),
        "silu(gate) * up of quant_linear over W = [gate; up] (n = 2 I, I % 16 == 0), float32 x and out [M, I]: the bits "
        "of silu_and_mul over quant_linear's float32 output, fused where the AVX2 kernels are built");
  m.def("quant_linear_bf16_silu", &pagedserve::quant_linear_bf16_silu, py::arg("x"), py::arg("packed"),
        py::arg("type_id"), py::arg("n"), py::arg("k"),
        "silu(gate) * up of quant_linear_bf16 over W = [gate; up] (n = 2 I, I % 16 == 0), bf16 [M, I]: the bits of "
        "silu_and_mul over its bf16 output, fused where the AMX many-rows route runs");
  m.def("has_quant_i8", &pagedserve::has_quant_i8, "whether quant_linear_i8 is built (AVX2)");
  m.def("quant_i8_types", &pagedserve::quant_i8_types, "the ggml type ids quant_linear_i8 takes in this build");
  m.def("has_quant_i8_vnni", &pagedserve::has_quant_i8_vnni,
        "whether quant_linear_i8 runs the AVX512-VNNI + VBMI kernels (else the AVX2 ones: the same bits)");
  m.def("quant_linear_i8", &pagedserve::quant_linear_i8, py::arg("x"), py::arg("packed"), py::arg("type_id"),
        py::arg("n"), py::arg("k"), py::arg("bias"), py::arg("out_dtype"),
        "W . Q(x) (+ bias): Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks against x quantized to int8 per 32-k block (llama.cpp's "
        "activations), integer dot products, one float32 chain per output");
  m.def("quant_embedding", &pagedserve::quant_embedding, py::arg("ids"), py::arg("packed"), py::arg("type_id"),
        py::arg("k"), py::arg("out_dtype"), "rows of the dequantized weight (gguf-py's float32 values, then cast)");
  m.def("gguf_block_layouts", []() {
    // (type id, name, block bytes, quant offset, quant bytes, min offset): the C++ side of the table in
    // pagedserve/model/matmul.py.
    std::vector<std::tuple<int64_t, std::string, int64_t, int64_t, int64_t, int64_t>> out;
    for (const auto& l : pagedserve::kGgufLayouts) {
      out.emplace_back(l.type, l.name, l.block_bytes, l.quant_offset, l.quant_bytes, l.min_offset);
    }
    return out;
  });
  m.def("has_avx512", []() {
#ifdef __AVX512F__
    return true;
#else
    return false;
#endif
  });
}
