// Every decoder layer of one decode step in a single call: for a few sequences (single-stream latency), and for
// any number of them where every matmul runs one route at every row count (the GGUF blocks' and the fixed-order
// routes: llama.py decides).
//
// With one to four new tokens, a step is ~10 small kernels per layer; from Python each costs more in
// interpreter and dispatch overhead than in work (with many sequences, a few percent of the step). DecodeStack
// holds the layers' weights and caches once and runs the same kernels, in the same order, as the model's fused
// Python path (so the two agree):
//   norm (fused with the previous residual add) -> qkv matmul -> [QK-norm] -> rotary + K/V write -> paged decode
//   attention -> o matmul -> [norm] -> residual add + norm -> gate_up matmul -> SwiGLU | GeGLU -> down matmul
//   -> [norm]
// The bracketed steps are Qwen3's (QK-norm) and Gemma 3's (QK-norm and the sandwich norms after attention and
// after the MLP; GeGLU; its sliding layers' own rotary table; every norm rounded once, `norm_once`).
// Each matmul runs the route Python chose for it at load (pagedserve/model/matmul.py); nothing is
// decided here.
#include <algorithm>
#include <atomic>
#include <exception>
#include <optional>
#include <thread>
#include <vector>

#include <omp.h>
#include <sched.h>

#include "common.h"
#include "ops.h"

namespace pagedserve {

// How a matmul of a few rows runs. The values are pagedserve/model/matmul.py's Route (a test checks them
// through the `matmul_routes` binding).
enum Route : int64_t { kLinear = 0, kBf16Gemv = 1, kGgufRows = 2, kGgufR16 = 3, kFixed = 5, kQuant = 7, kQuantBf16 = 8,
                     kQuantI8 = 9 };

// One matmul: its route, the plain weight and bias, and for the GGUF routes the block tensors
// ([blocks] in GGUF's row layout, or [qs, scales, mins] regrouped by 16 rows; mins empty unless Q4_1),
// for the batch-invariant route the weight packed by fixed_pack ([packed]; output in x's dtype), for the
// quantized route quant_pack's list with qtype the ggml type id (on the bf16 route also a lane-local packing's:
// quant_lanes_type) and n the output columns (no dense weight: `weight` may be undefined; output in x's dtype).
struct MatmulSpec {
  int64_t route;
  torch::Tensor weight;
  c10::optional<torch::Tensor> bias;
  std::vector<torch::Tensor> q;
  int64_t qtype;
  int64_t n = -1;  // output columns; -1: weight.size(0)
  // Further quantized parts of the same matmul (a fused weight whose parts have different block types, as Gemma 3's
  // q/k Q5_0 beside v Q8_0): their outputs follow this one's columns, as the model's Python path concatenates them.
  std::vector<MatmulSpec> more = {};

  int64_t out_features() const { return n >= 0 ? n : (weight.defined() && weight.dim() == 2 ? weight.size(0) : -1); }

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (!more.empty()) {
      std::vector<torch::Tensor> outs{one(x)};
      for (const auto& m : more) outs.push_back(m(x));
      return torch::cat(outs, 1);
    }
    return one(x);
  }

  torch::Tensor one(const torch::Tensor& x) const {
    switch (route) {
      case kGgufR16:
        return gemv_gguf_r16(x, q[0], q[1], q[2].numel() ? c10::optional<torch::Tensor>(q[2]) : c10::nullopt,
                             qtype, bias);
      case kGgufRows: return gemv_gguf(x, q[0], qtype, bias);
      case kBf16Gemv: return gemv_bf16(x, weight, bias);
      case kFixed: return fixed_linear(x, q[0], weight.size(0), bias, x.scalar_type());
      case kQuant: return quant_linear(x, q, qtype, out_features(), x.size(1), bias, x.scalar_type());
      case kQuantBf16: return quant_linear_bf16(x, q, qtype, out_features(), x.size(1), bias, x.scalar_type());
      case kQuantI8: return quant_linear_i8(x, q, qtype, out_features(), x.size(1), bias, x.scalar_type());
      default: return at::linear(x, weight, bias);
    }
  }

  // Whether silu() of x of dtype xt runs as one call: quant_linear_bf16_silu (the bf16 quantized route, bf16 x) or
  // quant_linear_silu (the float32 one, float32 x); one part, no bias, I % 16 == 0.
  bool silu_fused(c10::ScalarType xt) const {
    const bool takes = (route == kQuantBf16 && xt == torch::kBFloat16) || (route == kQuant && xt == torch::kFloat32);
    return takes && more.empty() && !bias && out_features() % 32 == 0;
  }

  // silu(gate) * up of this [gate; up] matmul in one call (where silu_fused).
  torch::Tensor fused_silu(const torch::Tensor& x) const {
    if (route == kQuantBf16) return quant_linear_bf16_silu(x, q, qtype, out_features(), x.size(1));
    return quant_linear_silu(x, q, qtype, out_features(), x.size(1));
  }

  // silu(gate) * up of this [gate; up] matmul: in one call where silu_fused (the same bits as the two ops, as the
  // model's MLP takes it), else the matmul then silu_and_mul.
  torch::Tensor silu(const torch::Tensor& x) const {
    if (silu_fused(x.scalar_type())) return fused_silu(x);
    return silu_and_mul((*this)(x));
  }
};

// One decoder layer: its two norms' weights (ln2: the norm before the MLP), its four matmuls and its slice of the
// paged KV cache; optionally (undefined tensors where not) the norms of each q and k head (Qwen3, Gemma 3), of the
// attention's and of the MLP's output (Gemma's sandwich norms), whether the layer takes the second rotary table and
// its sliding window (Gemma 3's sliding layers).
struct DecodeLayer {
  torch::Tensor ln1, ln2;
  MatmulSpec qkv, o, gate_up, down;
  torch::Tensor k_cache, v_cache;
  torch::Tensor q_norm = {}, k_norm = {}, attn_out_norm = {}, mlp_out_norm = {};
  bool local_rope = false;
  int64_t window = 0;  // sliding window (Gemma's sliding layers): each sequence's last `window` keys; 0: all
};

// Whether DecodeStack runs a step of few sequences as one team (see Team in common.h); set_decode_team switches it
// (tests and benchmarks compare the two: the same bits).
inline std::atomic<bool> g_decode_team{true};
inline std::atomic<int64_t> g_team_steps{0};  // steps run as a team (decode_team_steps: tests see which path ran)
bool set_decode_team(bool enabled) { return g_decode_team.exchange(enabled); }
int64_t decode_team_steps() { return g_team_steps.load(); }

class DecodeStack {
 public:
  // strict_attention: the strict mode's attention (paged_attention_rows), as the model's backend runs it.
  // gelu: GeGLU (gelu_tanh_and_mul) instead of SwiGLU; norm_once: every norm rounds once after its weight (Gemma).
  DecodeStack(std::vector<DecodeLayer> layers, int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
              bool strict_attention, bool gelu, bool norm_once)
      : layers_(std::move(layers)), H_(num_heads), KVH_(num_kv_heads), eps_(eps), scale_(scale),
        strict_attention_(strict_attention), gelu_(gelu), once_(norm_once) {
    TORCH_CHECK(!layers_.empty(), "DecodeStack: no layers");
    for (const auto& l : layers_) {
      std::vector<const MatmulSpec*> specs{&l.qkv, &l.o, &l.gate_up, &l.down};
      for (const MatmulSpec* top : {&l.qkv, &l.gate_up})
        for (const auto& m : top->more) {
          TORCH_CHECK(m.more.empty() && (m.route == kQuant || m.route == kQuantBf16 || m.route == kQuantI8) &&
                          m.route == top->route,
                      "DecodeStack: further parts of a matmul must be quantized parts of its route");
          specs.push_back(&m);
        }
      TORCH_CHECK(l.o.more.empty() && l.down.more.empty(), "DecodeStack: o and down are single matmuls");
      TORCH_CHECK(l.q_norm.defined() == l.k_norm.defined() && l.attn_out_norm.defined() == l.mlp_out_norm.defined(),
                  "DecodeStack: q_norm / k_norm and attn_out_norm / mlp_out_norm come in pairs");
      for (const MatmulSpec* m : specs) {
        const bool quant = m->route == kQuant || m->route == kQuantBf16 || m->route == kQuantI8;
        const size_t need = m->route == kGgufR16 ? 3 : ((m->route == kGgufRows || m->route == kFixed || quant) ? 1 : 0);
        const bool known = (m->route >= kLinear && m->route <= kGgufR16) || m->route == kFixed || quant;
        TORCH_CHECK(known && m->q.size() == need,
                    "DecodeStack: matmul route ", m->route, " with ", m->q.size(), " block tensors");
        if (quant) {
          TORCH_CHECK(quant_type_known(m->qtype) && m->out_features() >= 1,
                      "DecodeStack: a quantized matmul needs a quant_types() type id (or its lane-local packing's) "
                      "and n (got ", m->qtype, ", ",
                      m->out_features(), ")");
        }
      }
    }
    // The team's conditions on the stack itself (see team_applies): not the strict mode, every matmul (and each of its
    // parts) on a quantized route whose few-rows kernel splits between the members (claim_for; bf16 or int8
    // activations; float32 activations where the AVX2 GEMV runs them: quant_gemm's few-rows path, gemv_groups). Every
    // layer's cache shaped and typed as the first's, so one check of the attention serves all (team_applies).
#ifdef PAGEDSERVE_QUANT_AVX2
    constexpr bool float_gemv_team = true;
#else
    constexpr bool float_gemv_team = false;
#endif
    team_stack_ = !strict_attention_;
    for (const auto& l : layers_) {
      for (const MatmulSpec* m : {&l.qkv, &l.o, &l.gate_up, &l.down}) {  // parts: the same route
        team_stack_ = team_stack_ &&
                      (m->route == kQuantBf16 || m->route == kQuantI8 || (float_gemv_team && m->route == kQuant));
        team_float_ = team_float_ || m->route == kQuant;
      }
      team_stack_ = team_stack_ && l.k_cache.sizes().slice(1) == layers_[0].k_cache.sizes().slice(1) &&
                    l.k_cache.scalar_type() == layers_[0].k_cache.scalar_type();
    }
  }

  // Multi-step greedy decoding (LlamaForCausalLM.greedy_steps, the engine's num_scheduler_steps) where the embedding
  // and the head are GGUF blocks read in place: `steps` decode steps of the B sequences of ids, each step's argmaxes
  // the next step's tokens — per step quant_embedding (times embed_scale, a scalar in the embedding's dtype, as the
  // model multiplies), forward (with final_norm), quant_linear_bf16_argmax over the head's blocks (with head_screen,
  // its quant_screen_i8_norms where the model holds them): the calls one
  // step at a time makes, without a return to Python between them. positions / slot_mapping / seq_lens: [steps, B]
  // int64. Returns int64 [steps, B], fewer steps where a row's argmax is -1 (a NaN logit) before the last.
  torch::Tensor greedy_steps(torch::Tensor ids, std::vector<torch::Tensor> embed_packed, int64_t embed_type,
                             c10::ScalarType embed_dtype, c10::optional<double> embed_scale,
                             std::vector<torch::Tensor> head_packed, int64_t head_type, int64_t head_n,
                             torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                             torch::Tensor block_tables, torch::Tensor seq_lens, c10::optional<torch::Tensor> cos_local,
                             c10::optional<torch::Tensor> sin_local, torch::Tensor positions, torch::Tensor final_norm,
                             c10::optional<torch::Tensor> head_screen) {
    const int64_t steps = positions.size(0), B = ids.size(0), K = final_norm.size(0);
    for (const torch::Tensor* t : {&positions, &slot_mapping, &seq_lens})
      TORCH_CHECK(t->dim() == 2 && t->size(0) == steps && t->size(1) == B && t->scalar_type() == torch::kInt64 &&
                      t->is_contiguous(),
                  "DecodeStack.greedy_steps: positions, slot_mapping and seq_lens must be contiguous [steps, B] int64");
    TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64, "DecodeStack.greedy_steps: ids must be [B] int64");
    torch::Tensor out = torch::empty({steps, B}, torch::kInt64);
    torch::Tensor cur = ids;
    for (int64_t s = 0; s < steps; ++s) {
      torch::Tensor x = quant_embedding(cur, embed_packed, embed_type, K, embed_dtype);
      if (embed_scale) x = x * torch::scalar_tensor(*embed_scale, x.options());
      x = forward(x, cos, sin, slot_mapping[s], block_tables, seq_lens[s], cos_local, sin_local, positions[s],
                  final_norm);
      torch::Tensor got = quant_linear_bf16_argmax(x.to(torch::kBFloat16), head_packed, head_type, head_n, K,
                                                   c10::nullopt, head_screen);
      out[s].copy_(got);
      const int64_t* g = got.data_ptr<int64_t>();
      if (s + 1 < steps && std::any_of(g, g + B, [](int64_t t) { return t < 0; })) return out.narrow(0, 0, s + 1);
      cur = got;
    }
    return out;
  }

  // x: [B, hidden] embeddings of the B new tokens (one per sequence); cos/sin [B, D/2] float32 (cos_local /
  // sin_local: the local_rope layers' table); slot_mapping [B]; block_tables [B, W]; seq_lens [B]. Returns the last
  // layer's output + residual.
  // positions [B] int64: cos/sin (and cos_local/sin_local) are then whole [max_positions, D/2] tables, looked up here
  // (the rows Python's table[positions] takes). final_norm: the model's last norm's weight, applied to the result
  // (the bits of rms_norm over the returned rows). Both save a decode step a few Python-side tensor ops.
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                        torch::Tensor block_tables, torch::Tensor seq_lens, c10::optional<torch::Tensor> cos_local,
                        c10::optional<torch::Tensor> sin_local, c10::optional<torch::Tensor> positions,
                        c10::optional<torch::Tensor> final_norm) {
    const int64_t B = x.size(0), D = layers_[0].k_cache.size(3), q_size = H_ * D;
    if (positions) {
      TORCH_CHECK(positions->dim() == 1 && positions->size(0) == B && positions->scalar_type() == torch::kInt64 &&
                      positions->is_contiguous() && positions->device().is_cpu(),
                  "DecodeStack: positions must be contiguous [B] int64 on the CPU");
      const int64_t n = cos.size(0), *pos = positions->data_ptr<int64_t>();
      for (int64_t b = 0; b < B; ++b)
        TORCH_CHECK(pos[b] >= 0 && pos[b] < n, "DecodeStack: position ", pos[b], " is outside the rotary table (", n,
                    " positions)");
      cos = cos.index_select(0, *positions);
      sin = sin.index_select(0, *positions);
      if (cos_local) cos_local = cos_local->index_select(0, *positions);
      if (sin_local) sin_local = sin_local->index_select(0, *positions);
    }
    static const torch::Tensor no_rows = torch::empty({0}, torch::kInt64);
    if (const TeamAttention ta = team_applies(x, block_tables, seq_lens); ta != TeamAttention::kNone)
      return team_forward(x, cos, sin, cos_local, sin_local, slot_mapping, block_tables, seq_lens, final_norm, no_rows,
                          ta == TeamAttention::kSplit);
    const torch::Tensor qsl = strict_attention_ ? torch::arange(B + 1, torch::kInt64) : no_rows;
    torch::Tensor residual = x;
    torch::Tensor h = rms_norm(x, layers_[0].ln1, eps_, once_);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const DecodeLayer& l = layers_[i];
      if (i > 0) fused_add_rms_norm(h, residual, l.ln1, eps_, once_);
      torch::Tensor qkv = l.qkv(h);
      if (l.q_norm.defined()) rms_norm_heads(qkv, l.q_norm, l.k_norm, H_, KVH_, eps_, once_);
      TORCH_CHECK(!l.local_rope || (cos_local && sin_local), "DecodeStack: a local_rope layer needs cos_local/sin_local");
      if (l.local_rope) {
        rotary_write_kv(qkv, *cos_local, *sin_local, l.k_cache, l.v_cache, slot_mapping, H_, KVH_);
      } else {
        rotary_write_kv(qkv, cos, sin, l.k_cache, l.v_cache, slot_mapping, H_, KVH_);
      }
      torch::Tensor q = qkv.narrow(1, 0, q_size).view({B, H_, D});
      torch::Tensor attn;
      if (strict_attention_) {
        attn = paged_attention_rows(q, l.k_cache, l.v_cache, block_tables, seq_lens, qsl, scale_, l.window);
      } else {
        attn = torch::empty({B, H_, D}, qkv.options());
        paged_decode_attention(q, l.k_cache, l.v_cache, block_tables, seq_lens, no_rows, attn, scale_, l.window);
      }
      h = l.o(attn.view({B, q_size}));
      if (l.attn_out_norm.defined()) h = rms_norm(h, l.attn_out_norm, eps_, once_);
      fused_add_rms_norm(h, residual, l.ln2, eps_, once_);
      h = l.down(gelu_ ? gelu_tanh_and_mul(l.gate_up(h)) : l.gate_up.silu(h));
      if (l.mlp_out_norm.defined()) h = rms_norm(h, l.mlp_out_norm, eps_, once_);
    }
    if (final_norm) return rms_norm(h + residual, *final_norm, eps_, once_);
    return h + residual;
  }

 private:
  // The team (one parallel region for the whole step; see Team in common.h) takes a step of as many sequences as
  // every matmul runs its few-rows kernel for (split by claim_for): 4 (the vdpbf16ps route's GEMV and the float32
  // one), 16 where the bf16 matmuls run on AMX tiles (the int8 route takes any count 4 rows at a time); of a
  // team_stack_ (the constructor: the quantized routes, not the strict mode), no more threads than CPUs, and a decode
  // attention whose tasks split through team_for (kSplit: the AVX-512 kernel, or the AVX2 one over float32 queries;
  // see decode_attention_in_team) — or, in a build without the AVX-512 kernel, the other cases on thread 0 alone
  // (kThread0: the kernel converts the queries and forks, so it cannot take a share).
  enum class TeamAttention { kNone, kSplit, kThread0 };
  TeamAttention team_applies(const torch::Tensor& x, const torch::Tensor& block_tables,
                             const torch::Tensor& seq_lens) const {
    const int64_t B = x.size(0);
    const int64_t max_rows = amx_active() && !team_float_ ? 16 : 4;
    if (!team_stack_ || !g_decode_team.load() || B < 1 || B > max_rows || omp_in_parallel())
      return TeamAttention::kNone;
    // More threads than the CPUs this process runs on: spinning team members would hold each other off their cores
    // (a W2 step on 4 threads over 2 CPUs: 61 tok/s per region and op, 44 as a team).
    static const int64_t cpus = [] {
      cpu_set_t set;
      return sched_getaffinity(0, sizeof set, &set) == 0 ? static_cast<int64_t>(CPU_COUNT(&set))
                                                          : static_cast<int64_t>(std::thread::hardware_concurrency());
    }();
    const int64_t threads = at::get_num_threads();
    if (cpus > 0 && threads > cpus) return TeamAttention::kNone;
    const bool split = decode_attention_in_team(x.scalar_type(), H_, layers_[0].k_cache, block_tables, seq_lens);
#ifdef PAGEDSERVE_AVX512
    return split ? TeamAttention::kSplit : TeamAttention::kNone;
#else
    return split ? TeamAttention::kSplit : TeamAttention::kThread0;
#endif
  }

  // forward's ops in the same order on the same kernels (the same bits), in one parallel region: the matmuls (a SwiGLU
  // fused into gate_up's; their ranges claimed by whichever member is free), the rotary + K/V write, the attention
  // (split_attention; else on thread 0) and the SwiGLU / GeGLU of the other routes split between the threads
  // (team_for), the norms and the copies of a matmul's parts into its output on thread 0, the threads meeting at a
  // barrier after each op. The tensors each op writes are made before the region, so the threads share them (a norm's
  // output on thread 0: assigned before the barrier the others pass to read it).
  torch::Tensor team_forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                             const c10::optional<torch::Tensor>& cos_local, const c10::optional<torch::Tensor>& sin_local,
                             const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                             const torch::Tensor& seq_lens, const c10::optional<torch::Tensor>& final_norm,
                             const torch::Tensor& no_rows, bool split_attention) {
    ++g_team_steps;
    const DecodeLayer& l0 = layers_[0];
    const int64_t B = x.size(0), D = l0.k_cache.size(3), q_size = H_ * D, L = static_cast<int64_t>(layers_.size());
    torch::Tensor residual = x;
    torch::Tensor h = rms_norm(x, l0.ln1, eps_, once_);  // a layer's input (thread 0 assigns the next one)
    const auto opt = h.options();
    const auto width = [](const MatmulSpec& m) {  // all of a matmul's output columns (its parts' too)
      int64_t n = m.out_features();
      for (const auto& part : m.more) n += part.out_features();
      return n;
    };
    torch::Tensor qkv = torch::empty({B, width(l0.qkv)}, opt), attn = torch::empty({B, H_, D}, opt);
    const int64_t gu_width = width(l0.gate_up);
    torch::Tensor o_out = torch::empty({B, h.size(1)}, opt), act = torch::empty({B, gu_width / 2}, opt);
    torch::Tensor down_out = torch::empty({B, h.size(1)}, opt);
    bool mlp_unfused = gelu_;  // some layer's MLP is a gate_up matmul, then its SwiGLU / GeGLU
    for (const auto& l : layers_) mlp_unfused = mlp_unfused || !l.gate_up.silu_fused(h.scalar_type());
    const torch::Tensor gu = mlp_unfused ? torch::empty({B, gu_width}, opt) : torch::Tensor();  // [gate; up]
    const torch::Tensor q = qkv.narrow(1, 0, q_size).view({B, H_, D}), attn_rows = attn.view({B, q_size});
    // The parts of a matmul that has several (Gemma's q/k beside v of another type): each into its own output, then
    // copied into the matmul's columns.
    std::vector<std::vector<torch::Tensor>> parts(2 * L);  // layer i: qkv's at 2 i, gate_up's at 2 i + 1
    for (int64_t i = 0; i < L; ++i) {
      const DecodeLayer& l = layers_[i];
      for (const auto& [slot, m] : {std::pair{2 * i, &l.qkv}, std::pair{2 * i + 1, &l.gate_up}}) {
        if (m->more.empty()) continue;
        parts[slot].push_back(torch::empty({B, m->out_features()}, opt));
        for (const auto& part : m->more) parts[slot].push_back(torch::empty({B, part.out_features()}, opt));
      }
    }
    std::vector<float> scratch;  // the decode attention's, shared by the team (Team::scratch)
    // The counters the members' matmuls claim their work from (claim_for; Team::claims): per few-rows kernel call of
    // the step one per member, a matmul's part being one call and an int8 matmul one per 4 rows; beyond them the
    // members would take fixed shares.
    int64_t calls = 0;
    for (const auto& l : layers_) calls += 4 + static_cast<int64_t>(l.qkv.more.size() + l.gate_up.more.size());
    calls *= (B + 3) / 4;
    const int64_t stride = at::get_num_threads();  // a counter per member (OpenMP may give fewer)
    std::vector<ClaimCounter> counters(calls * stride);
    std::exception_ptr error;
    std::atomic<bool> failed{false};
    std::optional<TeamBarrier> barrier;
#pragma omp parallel num_threads(static_cast<int>(at::get_num_threads()))
    {
      const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();  // n: the team OpenMP gave
#pragma omp single
      barrier.emplace(n);  // (the end of single is a barrier: every thread sees it)
      TeamBarrier& bar = *barrier;
      TeamClaims claims{counters.data(), calls, stride};
      // Thread t's share of one matmul (or part) of `in` into `out` (matmul_output hands out `out`; the few-rows
      // drivers claim their ranges from `claims`, claim_for); silu: a [gate; up] matmul's fused SwiGLU
      // (MatmulSpec::fused_silu).
      auto one = [&](const MatmulSpec& m, const torch::Tensor& in, const torch::Tensor& out, bool silu = false) {
        g_team = {t, n, &out, nullptr, nullptr, &claims};
        if (silu) {
          m.fused_silu(in);
        } else if (m.route == kQuantI8) {
          quant_linear_i8(in, m.q, m.qtype, m.out_features(), in.size(1), m.bias, in.scalar_type());
        } else if (m.route == kQuant) {
          quant_linear(in, m.q, m.qtype, m.out_features(), in.size(1), m.bias, in.scalar_type());
        } else {
          quant_linear_bf16(in, m.q, m.qtype, m.out_features(), in.size(1), m.bias, in.scalar_type());
        }
        g_team = {};
      };
      // A whole matmul into `out`, its parts (if any) each into their own output, then copied by thread 0 after a
      // barrier. False: the team was aborted.
      auto matmul = [&](const MatmulSpec& m, const torch::Tensor& in, const torch::Tensor& out,
                        const std::vector<torch::Tensor>& own) {
        if (m.more.empty()) {
          one(m, in, out);
          return true;
        }
        one(m, in, own[0]);
        for (size_t j = 0; j < m.more.size(); ++j) one(m.more[j], in, own[j + 1]);
        if (!bar.wait()) return false;
        if (t == 0) {
          int64_t c = 0;
          for (const auto& part : own) {
            out.narrow(1, c, part.size(1)).copy_(part);
            c += part.size(1);
          }
        }
        return true;
      };
      try {
        for (int64_t i = 0; i < L; ++i) {
          const DecodeLayer& l = layers_[i];
          if (!matmul(l.qkv, h, qkv, parts[2 * i]) || !bar.wait()) break;
          if (l.q_norm.defined()) {
            if (t == 0) rms_norm_heads(qkv, l.q_norm, l.k_norm, H_, KVH_, eps_, once_);
            if (!bar.wait()) break;
          }
          TORCH_CHECK(!l.local_rope || (cos_local && sin_local), "DecodeStack: a local_rope layer needs cos_local/sin_local");
          g_team = {t, n, nullptr};
          rotary_write_kv(qkv, l.local_rope ? *cos_local : cos, l.local_rope ? *sin_local : sin, l.k_cache, l.v_cache,
                          slot_mapping, H_, KVH_);
          g_team = {};
          if (!bar.wait()) break;
          // split: each member's tasks (a split sequence's partitions' results in scratch); else the portable
          // kernel, whole, on thread 0 (see team_applies)
          if (split_attention) g_team = {t, n, nullptr, &bar, &scratch};
          if (split_attention || t == 0)
            paged_decode_attention(q, l.k_cache, l.v_cache, block_tables, seq_lens, no_rows, attn, scale_, l.window);
          g_team = {};
          if (!bar.wait()) break;
          one(l.o, attn_rows, o_out);
          if (!bar.wait()) break;
          if (t == 0) {
            h = l.attn_out_norm.defined() ? rms_norm(o_out, l.attn_out_norm, eps_, once_) : o_out;
            fused_add_rms_norm(h, residual, l.ln2, eps_, once_);
          }
          if (!bar.wait()) break;
          if (!gelu_ && l.gate_up.silu_fused(h.scalar_type())) {  // MatmulSpec::silu's one call
            one(l.gate_up, h, act, true);
          } else {
            if (!matmul(l.gate_up, h, gu, parts[2 * i + 1]) || !bar.wait()) break;
            g_team = {t, n, &act};
            gelu_ ? gelu_tanh_and_mul(gu) : silu_and_mul(gu);
            g_team = {};
          }
          if (!bar.wait()) break;
          one(l.down, act, down_out);
          if (!bar.wait()) break;
          if (t == 0) {  // the layer's output, and the next layer's input
            h = l.mlp_out_norm.defined() ? rms_norm(down_out, l.mlp_out_norm, eps_, once_) : down_out;
            if (i + 1 < L) fused_add_rms_norm(h, residual, layers_[i + 1].ln1, eps_, once_);
          }
          if (i + 1 < L && !bar.wait()) break;
        }
      } catch (...) {
        g_team = {};
        if (!failed.exchange(true)) error = std::current_exception();
        bar.abort();
      }
    }
    if (error) std::rethrow_exception(error);
    if (final_norm) return rms_norm(h + residual, *final_norm, eps_, once_);
    return h + residual;
  }

  std::vector<DecodeLayer> layers_;
  int64_t H_, KVH_;
  double eps_, scale_;
  bool strict_attention_, gelu_, once_;
  bool team_stack_ = false;        // the stack's part of team_applies (the constructor)
  bool team_float_ = false;        // some matmul on the float32 route, whose few-rows GEMV takes up to 4 rows
};

void bind_decode_stack(pybind11::module& m) {
  namespace py = pybind11;
  // module_local: two builds of these kernels (native and portable) may be loaded in one process.
  // weight may be None (the quantized route keeps no dense weight); n: output columns, needed then.
  py::class_<MatmulSpec>(m, "MatmulSpec", py::module_local())
      .def(py::init([](int64_t route, c10::optional<torch::Tensor> weight, c10::optional<torch::Tensor> bias,
                       std::vector<torch::Tensor> q, int64_t qtype, int64_t n, std::vector<MatmulSpec> more) {
             return MatmulSpec{route, weight.value_or(torch::Tensor()), std::move(bias), std::move(q), qtype, n,
                               std::move(more)};
           }),
           py::arg("route"), py::arg("weight"), py::arg("bias"), py::arg("q"), py::arg("qtype"), py::arg("n") = -1,
           py::arg("more") = std::vector<MatmulSpec>{});
  py::class_<DecodeLayer>(m, "DecodeLayer", py::module_local())
      .def(py::init([](torch::Tensor ln1, torch::Tensor ln2, MatmulSpec qkv, MatmulSpec o, MatmulSpec gate_up,
                       MatmulSpec down, torch::Tensor k_cache, torch::Tensor v_cache,
                       c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
                       c10::optional<torch::Tensor> attn_out_norm, c10::optional<torch::Tensor> mlp_out_norm,
                       bool local_rope, int64_t window) {
             TORCH_CHECK(window >= 0, "DecodeLayer: window must be >= 0 (0: none), got ", window);
             return DecodeLayer{ln1, ln2, std::move(qkv), std::move(o), std::move(gate_up), std::move(down), k_cache,
                                v_cache, q_norm.value_or(torch::Tensor()), k_norm.value_or(torch::Tensor()),
                                attn_out_norm.value_or(torch::Tensor()), mlp_out_norm.value_or(torch::Tensor()),
                                local_rope, window};
           }),
           py::arg("ln1"), py::arg("ln2"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"),
           py::arg("k_cache"), py::arg("v_cache"), py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(),
           py::arg("attn_out_norm") = py::none(), py::arg("mlp_out_norm") = py::none(), py::arg("local_rope") = false,
           py::arg("window") = 0);
  py::class_<DecodeStack>(m, "DecodeStack", py::module_local())
      .def(py::init<std::vector<DecodeLayer>, int64_t, int64_t, double, double, bool, bool, bool>(), py::arg("layers"),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("eps"), py::arg("scale"),
           py::arg("strict_attention") = false, py::arg("gelu") = false, py::arg("norm_once") = false)
      .def("forward", &DecodeStack::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("slot_mapping"),
           py::arg("block_tables"), py::arg("seq_lens"), py::arg("cos_local") = py::none(),
           py::arg("sin_local") = py::none(), py::arg("positions") = py::none(), py::arg("final_norm") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def("greedy_steps", &DecodeStack::greedy_steps, py::arg("ids"), py::arg("embed_packed"), py::arg("embed_type"),
           py::arg("embed_dtype"), py::arg("embed_scale"), py::arg("head_packed"), py::arg("head_type"),
           py::arg("head_n"), py::arg("cos"), py::arg("sin"), py::arg("slot_mapping"), py::arg("block_tables"),
           py::arg("seq_lens"), py::arg("cos_local"), py::arg("sin_local"), py::arg("positions"),
           py::arg("final_norm"), py::arg("head_screen") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("matmul_routes", []() {
    return std::vector<std::pair<std::string, int64_t>>{
        {"linear", kLinear}, {"bf16_gemv", kBf16Gemv}, {"gguf_rows", kGgufRows}, {"gguf_r16", kGgufR16},
        {"fixed", kFixed}, {"quant", kQuant}, {"quant_bf16", kQuantBf16},
        {"quant_i8", kQuantI8}};
  });
}

}  // namespace pagedserve
