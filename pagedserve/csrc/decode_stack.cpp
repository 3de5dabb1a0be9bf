// Every decoder layer of one decode step in a single call, for a few sequences (single-stream latency).
//
// With one to four new tokens, a step is ~10 small kernels per layer; from Python each costs more in
// interpreter and dispatch overhead than in work. DecodeStack holds the layers' weights and caches once
// and runs the same kernels, in the same order, as the model's fused Python path (so the two agree):
//   norm (fused with the previous residual add) -> qkv matmul -> rotary + K/V write -> paged decode
//   attention -> o matmul -> residual add + norm -> gate_up matmul -> SwiGLU -> down matmul.
// Matmuls read GGUF blocks where the model kept them, else use the AVX512-BF16 GEMV for bf16
// weights where built, else at::linear.
#include <optional>
#include <vector>

#include "ops.h"

namespace pagedserve {

namespace {
// A matmul of a few rows: from GGUF blocks when the weight has them, else the bf16 GEMV, else at::linear.
// qw: [] (none), [blocks] (GGUF row layout) or [qs, scales, mins] (regrouped by 16 rows; mins empty
// unless Q4_1).
torch::Tensor small_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                           const std::vector<torch::Tensor>& qw, int64_t qtype) {
  const auto bias = b.defined() ? c10::optional<torch::Tensor>(b) : c10::nullopt;
  if (qw.size() == 3) {
    const auto mins = qw[2].numel() ? c10::optional<torch::Tensor>(qw[2]) : c10::nullopt;
    return gemv_gguf_r16(x, qw[0], qw[1], mins, qtype, bias);
  }
  if (qw.size() == 1) return gemv_gguf(x, qw[0], qtype, bias);
  if (x.scalar_type() == torch::kBFloat16 && has_bf16_gemv() && x.size(0) <= 4) {
    return gemv_bf16(x, w, b.defined() ? c10::optional<torch::Tensor>(b) : c10::nullopt);
  }
  return at::linear(x, w, b.defined() ? c10::optional<torch::Tensor>(b) : c10::nullopt);
}
}  // namespace

class DecodeStack {
 public:
  // One entry per layer in each list; biases may be None (undefined tensors).
  DecodeStack(std::vector<torch::Tensor> ln1, std::vector<torch::Tensor> ln2, std::vector<torch::Tensor> w_qkv,
              std::vector<std::optional<torch::Tensor>> b_qkv, std::vector<torch::Tensor> w_o,
              std::vector<std::optional<torch::Tensor>> b_o, std::vector<torch::Tensor> w_gate_up,
              std::vector<std::optional<torch::Tensor>> b_gate_up, std::vector<torch::Tensor> w_down,
              std::vector<std::optional<torch::Tensor>> b_down, std::vector<torch::Tensor> k_caches,
              std::vector<torch::Tensor> v_caches, int64_t num_heads, int64_t num_kv_heads, double eps,
              double scale, std::vector<std::vector<torch::Tensor>> q_qkv, std::vector<std::vector<torch::Tensor>> q_o,
              std::vector<std::vector<torch::Tensor>> q_gate_up, std::vector<std::vector<torch::Tensor>> q_down,
              std::vector<int64_t> t_qkv, std::vector<int64_t> t_o, std::vector<int64_t> t_gate_up,
              std::vector<int64_t> t_down)
      : ln1_(std::move(ln1)), ln2_(std::move(ln2)), w_qkv_(std::move(w_qkv)), w_o_(std::move(w_o)),
        w_gate_up_(std::move(w_gate_up)), w_down_(std::move(w_down)), k_(std::move(k_caches)),
        v_(std::move(v_caches)), t_qkv_(std::move(t_qkv)), t_o_(std::move(t_o)), t_gate_up_(std::move(t_gate_up)),
        t_down_(std::move(t_down)), H_(num_heads), KVH_(num_kv_heads), eps_(eps), scale_(scale) {
    const size_t L = ln1_.size();
    TORCH_CHECK(ln2_.size() == L && w_qkv_.size() == L && b_qkv.size() == L && w_o_.size() == L && b_o.size() == L &&
                    w_gate_up_.size() == L && b_gate_up.size() == L && w_down_.size() == L && b_down.size() == L &&
                    k_.size() == L && v_.size() == L && q_qkv.size() == L && q_o.size() == L &&
                    q_gate_up.size() == L && q_down.size() == L && t_qkv_.size() == L && t_o_.size() == L &&
                    t_gate_up_.size() == L && t_down_.size() == L,
                "DecodeStack: every list needs one entry per layer");
    auto unwrap = [](const std::vector<std::optional<torch::Tensor>>& v) {
      std::vector<torch::Tensor> out;
      for (const auto& t : v) out.push_back(t.has_value() ? *t : torch::Tensor());
      return out;
    };
    b_qkv_ = unwrap(b_qkv);
    b_o_ = unwrap(b_o);
    b_gate_up_ = unwrap(b_gate_up);
    b_down_ = unwrap(b_down);
    q_qkv_ = std::move(q_qkv);
    q_o_ = std::move(q_o);
    q_gate_up_ = std::move(q_gate_up);
    q_down_ = std::move(q_down);
  }

  // x: [B, hidden] embeddings of the B new tokens (one per sequence); cos/sin [B, D/2] float32;
  // slot_mapping [B]; block_tables [B, W]; seq_lens [B]. Returns the last layer's output + residual.
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                        torch::Tensor block_tables, torch::Tensor seq_lens) {
    const int64_t B = x.size(0), D = k_[0].size(3), q_size = H_ * D;
    static const torch::Tensor no_rows = torch::empty({0}, torch::kInt64);
    torch::Tensor residual = x;
    torch::Tensor h = rms_norm(x, ln1_[0], eps_);
    for (size_t l = 0; l < ln1_.size(); ++l) {
      if (l > 0) fused_add_rms_norm(h, residual, ln1_[l], eps_);
      torch::Tensor qkv = small_linear(h, w_qkv_[l], b_qkv_[l], q_qkv_[l], t_qkv_[l]);
      rotary_write_kv(qkv, cos, sin, k_[l], v_[l], slot_mapping, H_, KVH_);
      torch::Tensor q = qkv.narrow(1, 0, q_size).view({B, H_, D});
      torch::Tensor attn = torch::empty({B, H_, D}, qkv.options());
      paged_decode_attention(q, k_[l], v_[l], block_tables, seq_lens, no_rows, attn, scale_);
      h = small_linear(attn.view({B, q_size}), w_o_[l], b_o_[l], q_o_[l], t_o_[l]);
      fused_add_rms_norm(h, residual, ln2_[l], eps_);
      torch::Tensor act = silu_and_mul(small_linear(h, w_gate_up_[l], b_gate_up_[l], q_gate_up_[l], t_gate_up_[l]));
      h = small_linear(act, w_down_[l], b_down_[l], q_down_[l], t_down_[l]);
    }
    return h + residual;
  }

 private:
  std::vector<torch::Tensor> ln1_, ln2_, w_qkv_, b_qkv_, w_o_, b_o_, w_gate_up_, b_gate_up_, w_down_, b_down_, k_, v_;
  std::vector<std::vector<torch::Tensor>> q_qkv_, q_o_, q_gate_up_, q_down_;  // GGUF blocks (see small_linear)
  std::vector<int64_t> t_qkv_, t_o_, t_gate_up_, t_down_;        // their ggml type ids
  int64_t H_, KVH_;
  double eps_, scale_;
};

void bind_decode_stack(pybind11::module& m) {
  // module_local: two builds of these kernels (native and portable) may be loaded in one process.
  pybind11::class_<DecodeStack>(m, "DecodeStack", pybind11::module_local())
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<std::optional<torch::Tensor>>, std::vector<torch::Tensor>,
                          std::vector<std::optional<torch::Tensor>>, std::vector<torch::Tensor>,
                          std::vector<std::optional<torch::Tensor>>, std::vector<torch::Tensor>,
                          std::vector<std::optional<torch::Tensor>>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, int64_t, int64_t, double, double,
                          std::vector<std::vector<torch::Tensor>>, std::vector<std::vector<torch::Tensor>>,
                          std::vector<std::vector<torch::Tensor>>, std::vector<std::vector<torch::Tensor>>,
                          std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>())
      .def("forward", &DecodeStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace pagedserve
