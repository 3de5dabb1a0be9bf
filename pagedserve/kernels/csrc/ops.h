// Declarations of pagedserve's CPU kernels, shared by the bindings and the fused decode stack.
#pragma once

#include <torch/extension.h>

namespace pagedserve {
void paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                            torch::Tensor seq_lens, torch::Tensor rows, torch::Tensor out, double scale,
                            int64_t window = 0);
torch::Tensor paged_attention_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                                   double scale, int64_t window = 0);
void paged_attention_rows_into(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                               torch::Tensor seq_lens, torch::Tensor query_start_loc, torch::Tensor rows,
                               torch::Tensor out, double scale, int64_t window = 0);
bool decode_attention_in_team(c10::ScalarType q_dtype, int64_t H, const torch::Tensor& k_cache,
                              const torch::Tensor& block_tables, const torch::Tensor& seq_lens);
bool set_decode_team(bool enabled);
int64_t decode_team_steps();
std::vector<std::tuple<int64_t, int64_t, int64_t>> claim_ranges_trace(int64_t n, int64_t threads, int64_t slow,
                                                                      int64_t slow_us);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, bool once = false);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps, bool once = false);
void rms_norm_heads(torch::Tensor qkv, torch::Tensor q_w, torch::Tensor k_w, int64_t H, int64_t KVH, double eps,
                    bool once);
void rotary_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                     torch::Tensor v_cache, torch::Tensor slot_mapping, int64_t H, int64_t KVH);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up);
torch::Tensor argmax_rows(torch::Tensor logits);
torch::Tensor sample_rows(torch::Tensor probs, torch::Tensor u);
torch::Tensor sample_logits(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k, torch::Tensor top_p,
                            torch::Tensor min_p, torch::Tensor u);
torch::Tensor filtered_weights(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k,
                               torch::Tensor top_p, torch::Tensor min_p);
std::vector<torch::Tensor> logprobs_rows(torch::Tensor logits, torch::Tensor rows, torch::Tensor tokens, int64_t k);
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows);
bool has_bf16_gemv();
torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
bool has_gguf_gemv();
torch::Tensor gemv_gguf(torch::Tensor x, torch::Tensor blocks, int64_t type, c10::optional<torch::Tensor> bias);
torch::Tensor gemv_gguf_r16(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, c10::optional<torch::Tensor> mins,
                            int64_t type, c10::optional<torch::Tensor> bias);
torch::Tensor fixed_pack(torch::Tensor w);
torch::Tensor fixed_linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias,
                           c10::ScalarType out_dtype);
// GGUF quantized weights read in place, batch-invariant (quant_gemm.cpp).
std::vector<int64_t> quant_types();
std::vector<torch::Tensor> quant_pack(torch::Tensor raw, int64_t type);
bool quant_type_known(int64_t type);
int64_t quant_lanes_type(int64_t type);
void quant_relayout(std::vector<torch::Tensor> packed, int64_t from_type, int64_t to_type);
torch::Tensor quant_linear(torch::Tensor x, std::vector<torch::Tensor> packed, int64_t type, int64_t N, int64_t K,
                           c10::optional<torch::Tensor> bias, c10::ScalarType out_dtype);
bool has_quant_bf16();
bool has_amx();
bool amx_active();
bool set_amx(bool enabled);
torch::Tensor quant_linear_bf16(torch::Tensor x, std::vector<torch::Tensor> packed, int64_t type, int64_t N, int64_t K,
                                c10::optional<torch::Tensor> bias, c10::ScalarType out_dtype);
torch::Tensor quant_linear_bf16_argmax(torch::Tensor x, std::vector<torch::Tensor> packed, int64_t type, int64_t N,
                                       int64_t K, c10::optional<torch::Tensor> bias,
                                       c10::optional<torch::Tensor> screen = c10::nullopt);
torch::Tensor quant_screen_i8_norms(std::vector<torch::Tensor> packed, int64_t type, int64_t N, int64_t K);
torch::Tensor quant_screen_norms(std::vector<torch::Tensor> packed, int64_t type, int64_t N, int64_t K);
torch::Tensor quant_linear_argmax(torch::Tensor x, std::vector<torch::Tensor> packed, int64_t type, int64_t N,
                                  int64_t K, torch::Tensor norms);
torch::Tensor quant_linear_silu(torch::Tensor x, std::vector<torch::Tensor> packed, int64_t type, int64_t N,
                                int64_t K);
torch::Tensor quant_linear_bf16_silu(torch::Tensor x, std::vector<torch::Tensor> packed, int64_t type, int64_t N,
                                     int64_t K);
bool has_quant_i8();
std::vector<int64_t> quant_i8_types();
bool has_quant_i8_vnni();
torch::Tensor quant_linear_i8(torch::Tensor x, std::vector<torch::Tensor> packed, int64_t type, int64_t N, int64_t K,
                              c10::optional<torch::Tensor> bias, c10::ScalarType out_dtype);
torch::Tensor quant_embedding(torch::Tensor ids, std::vector<torch::Tensor> packed, int64_t type, int64_t K,
                              c10::ScalarType out_dtype);
}  // namespace pagedserve
