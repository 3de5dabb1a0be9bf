// Fused elementwise work of a decoder layer on the CPU, one pass over memory each:
//   rms_norm, fused_add_rms_norm (residual add + norm, in place), rms_norm_heads (Qwen3's and Gemma 3's norms of
//   each q and k head, in place), rotary_write_kv (rotary on q and k in place + K/V scattered into the paged
//   cache), silu_and_mul (SwiGLU), gelu_tanh_and_mul (GeGLU).
// Each reproduces the reference (HF transformers) rounding points in bf16: values are rounded to the
// storage dtype wherever the reference materialises a bf16 tensor; arithmetic is float32.
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <cstring>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common.h"

namespace pagedserve {
namespace {

// Rows per parallel task: enough work that waking the second thread pays off.
inline int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

// One row's RMSNorm into out (out may be x). Two roundings of the reference, in bf16 (identical in float32):
//   Llama / Qwen / Mistral (once = false): weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), rounded again;
//   Gemma (once = true): (x * rsqrt(mean(x^2) + eps) * weight) in float32, rounded once.
template <typename S>
inline void norm_row(const S* x, const S* w, S* out, int64_t H, float eps, bool once) {
#ifdef PAGEDSERVE_AVX512BW
  if constexpr (std::is_same_v<S, uint16_t>) {  // bf16: 16 lanes at a time (the sum of squares in one fixed order)
    const int64_t H16 = H / 16 * 16;
    const __mmask16 tail = static_cast<__mmask16>((1u << (H - H16)) - 1u);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < H16; i += 16) {
      const __m512 v = load16(x + i);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    if (tail) {
      const __m512 v = load16(x + H16, tail);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const float r = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(H) + eps);
    const __m512 rv = _mm512_set1_ps(r);
    auto normed = [&](__m512 xv) { return once ? _mm512_mul_ps(xv, rv) : round16(_mm512_mul_ps(xv, rv)); };
    for (int64_t i = 0; i < H16; i += 16) store16(out + i, _mm512_mul_ps(normed(load16(x + i)), load16(w + i)));
    if (tail) store16(out + H16, _mm512_mul_ps(normed(load16(x + H16, tail)), load16(w + H16, tail)), tail);
    return;
  }
#endif
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) {
    const float v = Elem<S>::load(x[i]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  if (once) {
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) out[i] = Elem<S>::store(Elem<S>::load(x[i]) * r * Elem<S>::load(w[i]));
  } else {
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) out[i] = Elem<S>::store(round_to<S>(Elem<S>::load(x[i]) * r) * Elem<S>::load(w[i]));
  }
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, ": x must be [T, H] with contiguous rows");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1), what, ": weight must be [H]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), what, ": weight dtype must match x");
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, bool once) {
  check_rows(x, w, "rms_norm");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t T = x.size(0), H = x.size(1), xs = x.stride(0);
  dispatch_float_bf16(x, "rms_norm", [&]<typename S>() {
    const S* xp = ptr<S>(x);
    const S* wp = ptr<S>(w);
    S* op = ptr<S>(out);
    at::parallel_for(0, T, grain_rows(H), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) norm_row<S>(xp + t * xs, wp, op + t * H, H, static_cast<float>(eps), once);
    });
  });
  return out;
}

// residual <- x + residual (rounded to the dtype), x <- rms_norm(residual) * w. Both in place.
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps, bool once) {
  check_rows(x, w, "fused_add_rms_norm");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: x and residual must be contiguous tensors of the same shape and dtype");
  const int64_t T = x.size(0), H = x.size(1);
  dispatch_float_bf16(x, "fused_add_rms_norm", [&]<typename S>() {
    S* xp = ptr<S>(x);
    S* rp = ptr<S>(residual);
    const S* wp = ptr<S>(w);
    at::parallel_for(0, T, grain_rows(H), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        S* xr = xp + t * H;
        S* rr = rp + t * H;
        int64_t i0 = 0;
#ifdef PAGEDSERVE_AVX512
        if constexpr (std::is_same_v<S, uint16_t>) {
          for (; i0 + 16 <= H; i0 += 16) store16(rr + i0, _mm512_add_ps(load16(xr + i0), load16(rr + i0)));
        }
#endif
#pragma omp simd
        for (int64_t i = i0; i < H; ++i) rr[i] = Elem<S>::store(Elem<S>::load(xr[i]) + Elem<S>::load(rr[i]));
        norm_row<S>(rr, wp, xr, H, static_cast<float>(eps), once);
      }
    });
  });
}

// qkv: [T, (H + 2 * KVH) * D], contiguous rows: each of the H q heads normalised with q_w [D], each of the KVH k heads
// with k_w [D], in place (v untouched); `once` as in rms_norm.
void rms_norm_heads(torch::Tensor qkv, torch::Tensor q_w, torch::Tensor k_w, int64_t H, int64_t KVH, double eps,
                    bool once) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rms_norm_heads: qkv must be [T, width] with contiguous rows");
  const int64_t T = qkv.size(0), D = q_w.numel();
  TORCH_CHECK(q_w.dim() == 1 && k_w.dim() == 1 && k_w.numel() == D && q_w.is_contiguous() && k_w.is_contiguous() &&
                  qkv.size(1) == (H + 2 * KVH) * D,
              "rms_norm_heads: weights must be [D] and qkv [T, (H + 2 KVH) D]");
  TORCH_CHECK(q_w.scalar_type() == qkv.scalar_type() && k_w.scalar_type() == qkv.scalar_type(),
              "rms_norm_heads: weight dtype must match qkv");
  const int64_t qs = qkv.stride(0);
  dispatch_float_bf16(qkv, "rms_norm_heads", [&]<typename S>() {
    S* base = ptr<S>(qkv);
    const S* qw = ptr<S>(q_w);
    const S* kw = ptr<S>(k_w);
    at::parallel_for(0, T, grain_rows((H + KVH) * D), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        S* tok = base + t * qs;
        for (int64_t h = 0; h < H + KVH; ++h)
          norm_row<S>(tok + h * D, h < H ? qw : kw, tok + h * D, D, static_cast<float>(eps), once);
      }
    });
  });
}

// qkv: [T, (H + 2 * KVH) * D], contiguous rows. cos/sin: [T, D/2] float32 (rotate-half convention).
// Rotates q and k in place (float32 math, rounded once), then writes k and v of token t into the
// paged caches ([num_blocks, block_size, KVH, D], qkv's dtype) at flat slot slot_mapping[t].
void rotary_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                     torch::Tensor v_cache, torch::Tensor slot_mapping, int64_t H, int64_t KVH) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rotary_write_kv: qkv must be [T, width] with contiguous rows");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "rotary_write_kv: caches must be contiguous [num_blocks, block_size, KVH, D]");
  const int64_t T = qkv.size(0), D = k_cache.size(3), half = D / 2;
  TORCH_CHECK(k_cache.size(2) == KVH && qkv.size(1) == (H + 2 * KVH) * D, "rotary_write_kv: head shapes do not match");
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
              "rotary_write_kv: cache dtype must match qkv");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == T * half && sin.numel() == T * half,
              "rotary_write_kv: cos/sin must be contiguous float32 [T, D/2]");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() && slot_mapping.numel() == T,
              "rotary_write_kv: slot_mapping must be contiguous int64 [T]");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "rotary_write_kv: slot ", slots[t], " is outside the cache");
  }
  const int64_t qs = qkv.stride(0), row = KVH * D;
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  // Unit u = (token u / units, head u % units): q heads (rotated in place), then k heads (rotated, then copied into
  // the cache), then v heads (copied). Every unit writes its own elements: any split gives the same bits.
  const int64_t units = H + 2 * KVH;
  dispatch_float_bf16(qkv, "rotary_write_kv", [&]<typename S>() {
    S* base = ptr<S>(qkv);
    S* kc = ptr<S>(k_cache);
    S* vc = ptr<S>(v_cache);
    const auto unit = [&](int64_t t, int64_t h) {
      S* x = base + t * qs + h * D;
      if (h >= H + KVH) {
        std::memcpy(vc + slots[t] * row + (h - H - KVH) * D, x, D * sizeof(S));
        return;
      }
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      bool rotated = false;
#ifdef PAGEDSERVE_AVX512
      // bf16, 16 pairs per vector (the same arithmetic as the loop below compiles to: x1 c - (x2 s) and
      // x2 c + (x1 s), each a product rounded, then one fused multiply-add, rounded to bf16).
      if constexpr (std::is_same_v<S, uint16_t>) {
        if (half % 16 == 0) {
          for (int64_t i = 0; i < half; i += 16) {
            const __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
            const __m512 x1 = load16(x + i), x2 = load16(x + i + half);
            store16(x + i, _mm512_fmsub_ps(x1, cv, pinned(_mm512_mul_ps(x2, sv))));
            store16(x + i + half, _mm512_fmadd_ps(x2, cv, pinned(_mm512_mul_ps(x1, sv))));
          }
          rotated = true;
        }
      }
#endif
      if (!rotated) {
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = Elem<S>::load(x[i]), x2 = Elem<S>::load(x[i + half]);
          x[i] = Elem<S>::store(x1 * c[i] - x2 * s[i]);
          x[i + half] = Elem<S>::store(x2 * c[i] + x1 * s[i]);
        }
      }
      if (h >= H) std::memcpy(kc + slots[t] * row + (h - H) * D, x, D * sizeof(S));
    };
    if (g_team.t >= 0) {  // a decode step's team: this thread's share of the units (see Team)
      team_for(T * units, 1, [&](int64_t b, int64_t e) {
        for (int64_t u = b; u < e; ++u) unit(u / units, u % units);
      });
      return;
    }
    at::parallel_for(0, T, grain_rows(units * D), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        for (int64_t h = 0; h < units; ++h) unit(t, h);
    });
  });
}

namespace {
// gate_up: [T, 2 * I] -> [T, I]: act(gate) rounded to the dtype, times up, rounded -- the body of silu_and_mul and
// gelu_tanh_and_mul. vec(g, u): 16 bf16 lanes of the product before its rounding (AVX-512; nullptr: none); vec8(g, u):
// 8 float32 lanes of the product (AVX2 + FMA; nullptr: none); one(x): act in float32, for the other lanes and dtypes.
template <typename Vec, typename Vec8, typename One>
torch::Tensor act_and_mul(const torch::Tensor& gate_up, const char* name, [[maybe_unused]] Vec vec,
                          [[maybe_unused]] Vec8 vec8, One one) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0, name,
              ": input must be [T, 2 * I] with contiguous rows");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, gs = gate_up.stride(0);
  auto out = g_team.out ? *g_team.out : torch::empty({T, I}, gate_up.options());  // a team's: the shared output
  dispatch_float_bf16(gate_up, name, [&]<typename S>() {
    const S* in = ptr<S>(gate_up);
    S* op = ptr<S>(out);
    // Columns [c0, c1) of row t (each lane's bits whatever the split: 16-lane vectors from c0, a multiple of 16).
    const auto cols = [&](int64_t t, int64_t c0, int64_t c1) {
      const S* g = in + t * gs;
      const S* u = g + I;
      S* o = op + t * I;
      int64_t i0 = c0;
#ifdef PAGEDSERVE_AVX512
      if constexpr (std::is_same_v<S, uint16_t> && !std::is_same_v<Vec, std::nullptr_t>) {
        for (; i0 + 16 <= c1; i0 += 16) store16(o + i0, vec(load16(g + i0), load16(u + i0)));
      }
#endif
#ifdef PAGEDSERVE_QUANT_AVX2
      if constexpr (std::is_same_v<S, float> && !std::is_same_v<Vec8, std::nullptr_t>) {
        for (; i0 + 8 <= c1; i0 += 8)
          _mm256_storeu_ps(o + i0, vec8(_mm256_loadu_ps(g + i0), _mm256_loadu_ps(u + i0)));
      }
#endif
#pragma omp simd
      for (int64_t i = i0; i < c1; ++i) {
        const float act = round_to<S>(one(Elem<S>::load(g[i])));
        o[i] = Elem<S>::store(act * Elem<S>::load(u[i]));
      }
    };
    if (g_team.t >= 0) {  // a decode step's team: this thread's share of the rows' 16-column chunks (see Team)
      const int64_t chunks = (I + 15) / 16;
      team_for(T * chunks, 1, [&](int64_t b, int64_t e) {
        for (int64_t u = b; u < e; ++u) cols(u / chunks, u % chunks * 16, std::min(I, u % chunks * 16 + 16));
      });
      return;
    }
    at::parallel_for(0, T, grain_rows(2 * I), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) cols(t, 0, I);
    });
  });
  return out;
}
}  // namespace

// gate_up: [T, 2 * I] -> [T, I]: silu(gate) * up, each rounded to the dtype as the reference does. In bf16 with
// AVX-512, common.h's silu_mul16: the fused SwiGLU epilogue of quant_linear_bf16_silu runs the same function and must
// give the same bits (its arithmetic is pinned, so inlining it here or there computes the same operations); in float32
// with AVX2 + FMA, silu_mul8 for every 8 lanes, as quant_linear_silu's epilogue (the scalar form for a row's last
// I % 8).
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
#ifdef PAGEDSERVE_AVX512
  auto vec = [](__m512 g, __m512 u) { return silu_mul16(g, u); };
#else
  auto vec = nullptr;
#endif
#ifdef PAGEDSERVE_QUANT_AVX2
  auto vec8 = [](__m256 g, __m256 u) { return silu_mul8(g, u); };
#else
  auto vec8 = nullptr;
#endif
  // Clamped so exp stays finite (the kernels are built with -ffast-math): silu(x) ~ -0 there anyway.
  return act_and_mul(gate_up, "silu_and_mul", vec, vec8,
                     [](float x) { return x / (1.f + expf(std::min(-x, 80.f))); });
}

// gate_up: [T, 2 * I] -> [T, I]: gelu(gate) (the tanh approximation, transformers' gelu_pytorch_tanh) rounded to the
// dtype, times up, rounded (F.gelu(gate, approximate="tanh") * up in the dtype). 0.5 x (1 + tanh(y)) is computed as
// x / (1 + e^(-2 y)), y = sqrt(2 / pi) (x + 0.044715 x^3): the same function, a few float32 ulp from torch's
// (e^(-2 y) capped at e^80, as silu_and_mul's).
torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up) {
  constexpr float kBeta2 = -2.f * 0.7978845608028654f, kKappa = 0.044715f;
#ifdef PAGEDSERVE_AVX512
  auto vec = [](__m512 x, __m512 u) {
    const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 m2y = _mm512_mul_ps(_mm512_set1_ps(kBeta2), _mm512_fmadd_ps(_mm512_set1_ps(kKappa), x3, x));
    const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_min_ps(m2y, _mm512_set1_ps(80.f))));
    return _mm512_mul_ps(round16(_mm512_div_ps(x, den)), u);
  };
#else
  auto vec = nullptr;
#endif
  return act_and_mul(gate_up, "gelu_tanh_and_mul", vec, nullptr, [](float x) {
    const float m2y = kBeta2 * (kKappa * (x * x * x) + x);
    return x / (1.f + expf(std::min(m2y, 80.f)));
  });
}

}  // namespace pagedserve

namespace pagedserve {
namespace {

// Index of the first maximum of x[0:V] (torch.argmax's over finite logits), or -1 where one is NaN: a row whose logits
// went non-finite must fail its request (the sampler's in_vocab names it), never become a token. (torch.argmax would
// return the NaN's index; a plain `v > best` scan never moves past it and gave token 0.) The NaN test is an unordered
// compare intrinsic or the bits: -ffast-math lets the compiler assume v == v.
template <typename S>
int64_t argmax_row(const S* x, int64_t V) {
  int64_t start = 0, arg = 0;
  float best = Elem<S>::load(x[0]);
  bool nan = false;
#if defined(PAGEDSERVE_AVX512)
  if (V >= 32) {
    __m512 vbest = load16(x);
    __mmask16 nans = _mm512_cmp_ps_mask(vbest, vbest, _CMP_UNORD_Q);
    __m512i vidx = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i vbidx = vidx;
    const __m512i step = _mm512_set1_epi32(16);
    int64_t i = 16;
    for (; i + 16 <= V; i += 16) {
      vidx = _mm512_add_epi32(vidx, step);
      const __m512 v = load16(x + i);
      nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);  // strict: each lane keeps its first max
      vbest = _mm512_mask_mov_ps(vbest, gt, v);
      vbidx = _mm512_mask_mov_epi32(vbidx, gt, vidx);
    }
    if (nans) return -1;
    best = _mm512_reduce_max_ps(vbest);
    const __mmask16 eq = _mm512_cmp_ps_mask(vbest, _mm512_set1_ps(best), _CMP_EQ_OQ);
    arg = _mm512_mask_reduce_min_epi32(eq, vbidx);  // ties across lanes: the lowest index
    start = i;
  }
#elif defined(__AVX2__)
  if constexpr (std::is_same_v<S, float>) {  // the float32 logits an AVX2-only CPU's route writes
    if (V >= 16) {
      __m256 vbest = _mm256_loadu_ps(x);
      __m256 nans = _mm256_cmp_ps(vbest, vbest, _CMP_UNORD_Q);
      __m256i vidx = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
      __m256i vbidx = vidx;
      const __m256i step = _mm256_set1_epi32(8);
      int64_t i = 8;
      for (; i + 8 <= V; i += 8) {
        vidx = _mm256_add_epi32(vidx, step);
        const __m256 v = _mm256_loadu_ps(x + i);
        nans = _mm256_or_ps(nans, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256 gt = _mm256_cmp_ps(v, vbest, _CMP_GT_OQ);
        vbest = _mm256_blendv_ps(vbest, v, gt);
        vbidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vbidx), _mm256_castsi256_ps(vidx), gt));
      }
      if (_mm256_movemask_ps(nans)) return -1;
      alignas(32) float lanes[8];
      alignas(32) int32_t idx[8];
      _mm256_store_ps(lanes, vbest);
      _mm256_store_si256(reinterpret_cast<__m256i*>(idx), vbidx);
      best = lanes[0];
      arg = idx[0];
      for (int l = 1; l < 8; ++l)  // ties across lanes: the lowest index
        if (lanes[l] > best || (lanes[l] == best && idx[l] < arg)) {
          best = lanes[l];
          arg = idx[l];
        }
      start = i;
    }
  }
#endif
  for (int64_t i = start; i < V; ++i) {
    const float v = Elem<S>::load(x[i]);
    nan = nan || nan_bits(v);
    if (v > best) {
      best = v;
      arg = i;
    }
  }
  return nan ? -1 : arg;
}

}  // namespace

// logits: [R, V] float32 or bf16 with contiguous rows -> int64 [R]: greedy sampling without upcasting.
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "argmax_rows: logits must be [R, V] with contiguous rows");
  const int64_t R = logits.size(0), V = logits.size(1), ls = logits.stride(0);
  auto out = torch::empty({R}, logits.options().dtype(torch::kInt64));
  int64_t* op = out.data_ptr<int64_t>();
  dispatch_float_bf16(logits, "argmax_rows", [&]<typename S>() {
    const S* x = ptr<S>(logits);
    at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) op[r] = argmax_row<S>(x + r * ls, V);
    });
  });
  return out;
}

namespace {

inline bool finite_bits(double x) {  // -ffast-math lets the compiler assume std::isfinite
  uint64_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return ((bits >> 52) & 0x7ff) != 0x7ff;
}

}  // namespace

// One categorical draw per row by the inverse CDF: row r's (unnormalised, non-negative, float32) weights summed in
// double, in index order, and the first index whose running sum exceeds u[r] times the total (u in [0, 1)). A weight of
// 0 is never drawn (the running sum does not grow there); where rounding leaves no such index the last positive
// weight is drawn; a row with no positive weight or a non-finite sum gets -1 (the sampler names it in its error).
// One uniform per row instead of the exponential race's one per vocabulary entry (a 262,144-token vocabulary at 128
// rows took 0.7 s for those); torch's sequential double cumsum gives the same indices.
torch::Tensor sample_rows(torch::Tensor probs, torch::Tensor u) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == torch::kFloat32 && probs.stride(1) == 1 && probs.size(1) > 0,
              "sample_rows: probs must be float32 [R, V] with contiguous rows");
  TORCH_CHECK(u.dim() == 1 && u.scalar_type() == torch::kFloat64 && u.is_contiguous() && u.size(0) == probs.size(0),
              "sample_rows: u must be contiguous float64 [R]");
  const int64_t R = probs.size(0), V = probs.size(1), ps = probs.stride(0);
  auto out = torch::empty({R}, torch::TensorOptions().dtype(torch::kInt64));
  int64_t* op = out.data_ptr<int64_t>();
  const float* p = probs.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* row = p + r * ps;
      double total = 0.0;
      int64_t last = -1;  // the last positive weight
      for (int64_t i = 0; i < V; ++i) {
        total += row[i];
        if (row[i] > 0.f) last = i;
      }
      if (last < 0 || !finite_bits(total)) {
        op[r] = -1;
        continue;
      }
      const double t = up[r] * total;
      double acc = 0.0;
      int64_t pick = last;
      for (int64_t i = 0; i < V; ++i) {
        acc += row[i];
        if (acc > t) {
          pick = i;
          break;
        }
      }
      op[r] = pick;
    }
  });
  return out;
}

namespace {

// The order top-k / top-p walk the vocabulary in: logit descending, then index ascending (a torch stable sort's
// order), as one ascending uint64.
inline uint64_t rank_key(float l, int64_t i) {
  uint32_t b;
  std::memcpy(&b, &l, sizeof b);
  if (b == 0x80000000u) b = 0;  // -0 ties with +0, as in a float comparison
  const uint32_t ord = (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // grows with l
  return (static_cast<uint64_t>(~ord) << 32) | static_cast<uint64_t>(i);
}

struct SampleScratch {
  std::vector<float> w;
  std::vector<uint64_t> cand;
  std::vector<double> block;
};

// How many of the weights are >= tau, and their sum in double (one vectorised pass).
inline void weights_above(const float* w, int64_t V, float tau, int64_t* count, double* mass) {
  int64_t c = 0;
  double m = 0.0;
  int64_t i0 = 0;
#ifdef PAGEDSERVE_AVX512
  {  // (GCC does not vectorise the loop below: an int64 and a double sum of float loads)
    const __m512 t = _mm512_set1_ps(tau);
    __m512d m0 = _mm512_setzero_pd(), m1 = _mm512_setzero_pd();
    for (; i0 + 16 <= V; i0 += 16) {
      const __m512 x = _mm512_loadu_ps(w + i0);
      const __mmask16 a = _mm512_cmp_ps_mask(x, t, _CMP_GE_OQ);
      if (!a) continue;
      c += __builtin_popcount(static_cast<unsigned>(a));
      m0 = _mm512_mask_add_pd(m0, static_cast<__mmask8>(a), m0, _mm512_cvtps_pd(_mm512_castps512_ps256(x)));
      m1 = _mm512_mask_add_pd(m1, static_cast<__mmask8>(a >> 8), m1,
                              _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))));
    }
    m = _mm512_reduce_add_pd(_mm512_add_pd(m0, m1));
  }
#endif
  for (int64_t i = i0; i < V; ++i) {
    const bool a = w[i] >= tau;
    c += a ? 1 : 0;
    m += a ? static_cast<double>(w[i]) : 0.0;
  }
  *count = c;
  *mass = m;
}

// One row's weights after temperature (> 0) and the filters into w[0:V]: exp((l - max) / T) where kept, 0 elsewhere.
// False where the row cannot draw (a NaN or +inf logit, or nothing above -inf).
bool filtered_weights_row(const float* row, int64_t V, float temperature, int64_t top_k, double top_p, float min_p,
                          float* w, SampleScratch& s) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < V; ++i) m = std::max(m, row[i]);
  if (!finite_bits(m)) return false;
  const float inv_t = 1.f / temperature;
  float zf = 0.f;  // only to see a NaN
  for (int64_t i = 0; i < V; ++i) {
    w[i] = std::exp((row[i] - m) * inv_t);  // the row's maximum gets exactly 1
    zf += w[i];
  }
  if (!finite_bits(zf)) return false;

  const int64_t k = top_k > 0 ? std::min(top_k, V) : V;
  bool cut = false;
  uint64_t last_kept = 0;  // with cut: the largest kept rank_key
  if (k < V || top_p < 1.0) {
    const float tiny = std::numeric_limits<float>::denorm_min();
    int64_t npos = 0;  // the positive weights, and their sum
    double z = 0.0;
    weights_above(w, V, tiny, &npos, &z);
    const bool k_cuts = k < npos;
    if (k_cuts || top_p < 1.0) {
      // Candidates: the weights >= tau for the largest tau = 2^-e (e = 0 .. 120: w is in [0, 1]) above which lie
      // the top k, or the top_p mass, else every positive weight; only they are ranked. e is found by counting
      // passes: steps of 2^-8 (most rows stop at the first or second), then bisection inside the step.
      auto enough = [&](int e) {
        int64_t c = 0;
        double mm = 0.0;
        weights_above(w, V, std::ldexp(1.f, -e), &c, &mm);
        return k_cuts ? c >= k : mm >= top_p * z;
      };
      float tau = tiny;
      int hi = -1;  // enough(hi)
      for (int e = 8; e <= 120; e += 8)
        if (enough(e)) {
          hi = e;
          break;
        }
      if (hi >= 0) {
        int lo = hi - 8;  // not enough(lo), or lo = 0 untried
        if (lo == 0 && enough(0)) hi = 0;
        while (hi - lo > 1) {
          const int mid = (lo + hi) / 2;
          (enough(mid) ? hi : lo) = mid;
        }
        tau = std::ldexp(1.f, -hi);
      }
      for (;;) {
        s.cand.resize(V);
        uint64_t* c = s.cand.data();
        int64_t n = 0, i = 0;
#ifdef PAGEDSERVE_AVX512
        const __m512 tv = _mm512_set1_ps(tau);
        for (; i + 16 <= V; i += 16)  // 16 weights per compare; most hold no candidate
          for (uint32_t a = _mm512_cmp_ps_mask(_mm512_loadu_ps(w + i), tv, _CMP_GE_OQ); a; a &= a - 1) {
            const int64_t j = i + __builtin_ctz(a);
            c[n++] = rank_key(row[j], j);
          }
#endif
        for (; i < V; ++i)
          if (w[i] >= tau) c[n++] = rank_key(row[i], i);
        int64_t sorted = 0;
        auto sort_upto = [&](int64_t upto) {  // c[0:upto) in order (chunks: a select, then a sort)
          while (sorted < upto) {
            const int64_t next = std::min(n, std::max(upto, sorted + 1024));
            if (next < n) std::nth_element(c + sorted, c + next, c + n);
            std::sort(c + sorted, c + next);
            sorted = next;
          }
        };
        auto weight = [&](int64_t j) { return w[static_cast<int64_t>(c[j] & 0xffffffffu)]; };
        const int64_t limit = k_cuts ? k : n;
        double zk = z;
        if (k_cuts) {  // the top-p mass is of the top k
          sort_upto(k);
          zk = 0.0;
          for (int64_t j = 0; j < k; ++j) zk += weight(j);
        }
        int64_t kept = limit;
        bool stopped = k_cuts;  // the top k are all candidates
        if (top_p < 1.0) {
          const double target = top_p * zk;
          double acc = 0.0;
          for (int64_t j = 0; j < limit; ++j) {
            if (j > 0 && acc >= target) {  // the smallest prefix reaching top_p (the first stays)
              kept = j;
              stopped = true;
              break;
            }
            if (j == sorted) sort_upto(j + 1);
            acc += weight(j);
          }
          if (!stopped && acc >= target) stopped = true;  // the smallest prefix is every candidate
        }
        if (!stopped && tau > tiny) {  // the mass fell short of top_p by rounding: take every positive weight
          tau = tiny;
          continue;
        }
        sort_upto(kept);
        cut = true;
        last_kept = c[kept - 1];
        break;
      }
    }
  }
  if (cut || min_p > 0.f) {  // what the filters drop gets weight 0
    float lstar = std::numeric_limits<float>::infinity();
    int64_t istar = -1;
    if (cut) {  // kept: logit above the last kept one's, or equal to it at an index not after it
      const uint32_t ord = ~static_cast<uint32_t>(last_kept >> 32);
      const uint32_t b = (ord & 0x80000000u) ? (ord & 0x7fffffffu) : ~ord;
      std::memcpy(&lstar, &b, sizeof lstar);
      istar = static_cast<int64_t>(last_kept & 0xffffffffu);
    } else {
      lstar = -std::numeric_limits<float>::infinity();
      istar = V;
    }
    for (int64_t i = 0; i < V; ++i) {
      const bool keep = (row[i] > lstar || (row[i] == lstar && i <= istar)) && w[i] >= min_p;
      w[i] = keep ? w[i] : 0.f;
    }
  }
  return true;
}

// One row of sample_logits: returns the drawn index or -1.
int64_t sample_logits_row(const float* row, int64_t V, float temperature, int64_t top_k, double top_p, float min_p,
                          double u, SampleScratch& s) {
  if (temperature == 0.f) return argmax_row<float>(row, V);
  s.w.resize(V);
  float* w = s.w.data();
  if (!filtered_weights_row(row, V, temperature, top_k, top_p, min_p, w, s)) return -1;
  // The inverse CDF over blocks of 64 weights: each block's sum in double (vectorised), the running sum over the
  // blocks, then weight by weight inside the block where it crosses u times the total.
  constexpr int64_t kB = 64;
  const int64_t nb = (V + kB - 1) / kB;
  s.block.resize(nb);
  double* bs = s.block.data();
  for (int64_t blk = 0; blk < nb; ++blk) {
    const int64_t i0 = blk * kB, i1 = std::min(V, i0 + kB);
    double acc = 0.0;
    for (int64_t i = i0; i < i1; ++i) acc += w[i];
    bs[blk] = acc;
  }
  double total = 0.0;
  for (int64_t blk = 0; blk < nb; ++blk) total += bs[blk];
  if (!(total > 0.0) || !finite_bits(total)) return -1;
  const double t = u * total;
  double acc = 0.0;
  for (int64_t blk = 0; blk < nb; ++blk) {
    if (acc + bs[blk] <= t) {
      acc += bs[blk];
      continue;
    }
    const int64_t i0 = blk * kB, i1 = std::min(V, i0 + kB);
    for (int64_t i = i0; i < i1; ++i) {
      acc += w[i];
      if (acc > t && w[i] > 0.f) return i;
    }
  }
  for (int64_t i = V - 1; i >= 0; --i)  // rounding past the end: the last positive weight
    if (w[i] > 0.f) return i;
  return -1;
}

// One row's logprobs (logits l, its log-sum-exp lse): the chosen token's l - lse and its rank (1 + the number of
// logits above it), and the k largest as (index, l - lse), largest first, ties in index order.
void logprobs_row(const float* l, int64_t V, int64_t token, int64_t k, float* chosen, int64_t* rank, int64_t* ids,
                  float* vals) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < V; ++i) m = std::max(m, l[i]);
  // The sum in double: in float32 lanes, a large vocabulary's many small terms fall below the sum's last bit and
  // are lost (262,144 logits of scale 4: 5e-5 low, twice torch's own float32 error).
  double z = 0.0;
  for (int64_t i = 0; i < V; ++i) z += std::exp(l[i] - m);
  const float lse = static_cast<float>(static_cast<double>(m) + std::log(z));
  const float lt = l[token];
  int64_t above = 0;
  for (int64_t i = 0; i < V; ++i) above += l[i] > lt;
  *chosen = lt - lse;
  *rank = above + 1;
  // The k best so far, best first: a logit enters only above the k-th (ties keep the earlier index).
  int64_t n = 0;
  float kth = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < V; ++i) {
    const float v = l[i];
    if (n == k && !(v > kth)) continue;
    int64_t j = n < k ? n++ : k - 1;
    while (j > 0 && v > l[ids[j - 1]]) {
      ids[j] = ids[j - 1];
      --j;
    }
    ids[j] = i;
    if (n == k) kth = l[ids[k - 1]];
  }
  for (int64_t j = 0; j < k; ++j) vals[j] = l[ids[j]] - lse;
}

// The float32 logits [R, V] (contiguous rows) and per-row temperature, top_k, top_p, min_p of sample_logits and
// filtered_weights, checked (the error names the op and the argument).
struct FilterArgs {
  int64_t R, V, ls;
  const float* x;
  const float *temperature, *top_p, *min_p;
  const int64_t* top_k;

  FilterArgs(const char* op, const torch::Tensor& logits, const torch::Tensor& t, const torch::Tensor& k,
             const torch::Tensor& p, const torch::Tensor& mp) {
    TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.stride(1) == 1 &&
                    logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 32),
                op, ": logits must be float32 [R, V] with contiguous rows");
    R = logits.size(0), V = logits.size(1), ls = logits.stride(0);
    auto check = [&](const torch::Tensor& v, torch::ScalarType dt, const char* name) {
      TORCH_CHECK(v.dim() == 1 && v.scalar_type() == dt && v.is_contiguous() && v.size(0) == R, op, ": ", name,
                  " must be a contiguous [R] tensor of ", c10::toString(dt));
    };
    check(t, torch::kFloat32, "temperature");
    check(k, torch::kInt64, "top_k");
    check(p, torch::kFloat32, "top_p");
    check(mp, torch::kFloat32, "min_p");
    x = logits.data_ptr<float>();
    temperature = t.data_ptr<float>(), top_p = p.data_ptr<float>(), min_p = mp.data_ptr<float>();
    top_k = k.data_ptr<int64_t>();
  }
  const float* row(int64_t r) const { return x + r * ls; }
};

}  // namespace

// The sampler's whole draw per row on the CPU, from the (adjusted) float32 logits: temperature (0: the argmax), top-k,
// top-p, min-p, and one inverse-CDF draw (as sample_rows) over the weights exp((l - max) / T) that stay, without
// materialising probabilities, sorting the vocabulary or allocating [R, V] tensors. The filters as the torch path's:
// top-k keeps the first k in (logit descending, index ascending) order, top-p the smallest prefix of the top k whose
// share of their mass reaches top_p (the first always stays), min-p the weights >= min_p times the largest. Only the
// candidates a top-k / top-p cut can reach are sorted: those at or above the highest power of two that holds the top
// k (or the top_p mass), found by vectorised counting passes.
torch::Tensor sample_logits(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k, torch::Tensor top_p,
                            torch::Tensor min_p, torch::Tensor u) {
  const FilterArgs a("sample_logits", logits, temperature, top_k, top_p, min_p);
  TORCH_CHECK(u.dim() == 1 && u.scalar_type() == torch::kFloat64 && u.is_contiguous() && u.size(0) == a.R,
              "sample_logits: u must be a contiguous float64 [R] tensor");
  auto out = torch::empty({a.R}, torch::TensorOptions().dtype(torch::kInt64));
  int64_t* op = out.data_ptr<int64_t>();
  const double* up = u.data_ptr<double>();
  at::parallel_for(0, a.R, 1, [&](int64_t b, int64_t e) {
    thread_local SampleScratch scratch;
    for (int64_t r = b; r < e; ++r)
      op[r] = sample_logits_row(a.row(r), a.V, a.temperature[r], a.top_k[r], a.top_p[r], a.min_p[r], up[r], scratch);
  });
  return out;
}

// The distributions sample_logits draws from, as [R, V] float32 weights (unnormalised: each row's largest kept weight is
// 1): what speculative decoding's verification reads. A row at temperature 0 is one-hot at its argmax; a row that
// cannot draw is NaN.
torch::Tensor filtered_weights(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k,
                               torch::Tensor top_p, torch::Tensor min_p) {
  const FilterArgs a("filtered_weights", logits, temperature, top_k, top_p, min_p);
  const int64_t V = a.V;
  auto out = torch::empty({a.R, V}, torch::TensorOptions().dtype(torch::kFloat32));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, a.R, 1, [&](int64_t b, int64_t e) {
    thread_local SampleScratch scratch;
    for (int64_t r = b; r < e; ++r) {
      float* w = op + r * V;
      const int64_t top = a.temperature[r] == 0.f ? argmax_row<float>(a.row(r), V) : 0;
      if (a.temperature[r] == 0.f && top >= 0) {
        std::fill(w, w + V, 0.f);
        w[top] = 1.f;
      } else if (top < 0 ||
                 !filtered_weights_row(a.row(r), V, a.temperature[r], a.top_k[r], a.top_p[r], a.min_p[r], w, scratch)) {
        std::fill(w, w + V, std::numeric_limits<float>::quiet_NaN());
      }
    }
  });
  return out;
}

// Logprobs of the rows that asked (rows [n] into logits' rows, tokens [n] their sampled ids, k >= 1 the most top
// logprobs any of them asked for): (chosen [n] float32, rank [n] int64, top ids [n, k] int64, top logprobs [n, k]
// float32), the model's raw distribution (log-softmax), without a [n, vocab] log-softmax or a top-k over it.
std::vector<torch::Tensor> logprobs_rows(torch::Tensor logits, torch::Tensor rows, torch::Tensor tokens, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.stride(1) == 1 &&
                  logits.size(1) > 0,
              "logprobs_rows: logits must be float32 [R, V] with contiguous rows");
  const int64_t R = logits.size(0), V = logits.size(1), ls = logits.stride(0), n = rows.numel();
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt64 && rows.is_contiguous() && tokens.dim() == 1 &&
                  tokens.scalar_type() == torch::kInt64 && tokens.is_contiguous() && tokens.numel() == n,
              "logprobs_rows: rows and tokens must be contiguous int64 [n]");
  TORCH_CHECK(k >= 1 && k <= V, "logprobs_rows: k must be in [1, V]");
  const int64_t *rp = rows.data_ptr<int64_t>(), *tp = tokens.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j)
    TORCH_CHECK(rp[j] >= 0 && rp[j] < R && tp[j] >= 0 && tp[j] < V, "logprobs_rows: row or token out of range");
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32), i64 = torch::TensorOptions().dtype(torch::kInt64);
  auto chosen = torch::empty({n}, f32), top_vals = torch::empty({n, k}, f32);
  auto rank = torch::empty({n}, i64), top_ids = torch::empty({n, k}, i64);
  const float* x = logits.data_ptr<float>();
  float *cp = chosen.data_ptr<float>(), *vp = top_vals.data_ptr<float>();
  int64_t *kp = rank.data_ptr<int64_t>(), *ip = top_ids.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) logprobs_row(x + rp[j] * ls, V, tp[j], k, cp + j, kp + j, ip + j * k, vp + j * k);
  });
  return {chosen, rank, top_ids, top_vals};
}

}  // namespace pagedserve

namespace pagedserve {

#if defined(__AVX512BF16__) && defined(__AVX512F__)
namespace {

constexpr int64_t kMaxGemvRows = 4;
constexpr int64_t kPrefetchRows = 4;  // software prefetch this many weight rows ahead

// y[m, n] = x[m, :] . w[n, :] (+ bias[n]) for up to kMaxGemvRows rows of x, bf16 in, float32 sums.
// Decode-sized matmuls are bound by reading w once: each 32-element chunk of a weight row is loaded
// once and multiplied into every row of x with AVX512-BF16 pair dot products.
template <int M>
void gemv_rows(const uint16_t* x, int64_t xs, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t ys,
               int64_t n0, int64_t n1, int64_t K) {
  const int64_t K32 = K / 32 * 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* row = w + n * K;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K32; k += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * K + k), _MM_HINT_T0);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(row + k);
      for (int m = 0; m < M; ++m) {
        acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_loadu_si512(x + m * xs + k));
      }
    }
    for (int m = 0; m < M; ++m) {
      float s = _mm512_reduce_add_ps(acc[m]);
      for (int64_t k = K32; k < K; ++k) s += Elem<uint16_t>::load(row[k]) * Elem<uint16_t>::load(x[m * xs + k]);
      if (bias) s += Elem<uint16_t>::load(bias[n]);
      y[m * ys + n] = Elem<uint16_t>::store(s);
    }
  }
}

}  // namespace

bool has_bf16_gemv() { return true; }

torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16,
              "gemv_bf16: x and w must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.dim() == 2 && w.is_contiguous() && x.size(1) == w.size(1),
              "gemv_bf16: x [M, K] (contiguous rows) and w [N, K] (contiguous) expected");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxGemvRows, "gemv_bf16: 1 to ", kMaxGemvRows, " rows");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous() && bias->numel() == w.size(0),
                "gemv_bf16: bias must be contiguous bf16 [N]");
  }
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  auto y = torch::empty({M, N}, x.options());
  const uint16_t* xp = ptr<uint16_t>(x);
  const uint16_t* wp = ptr<uint16_t>(w);
  const uint16_t* bp = has_bias ? ptr<uint16_t>(*bias) : nullptr;
  uint16_t* yp = ptr<uint16_t>(y);
  const int64_t xs = x.stride(0);
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: gemv_rows<1>(xp, xs, wp, bp, yp, N, n0, n1, K); break;
      case 2: gemv_rows<2>(xp, xs, wp, bp, yp, N, n0, n1, K); break;
      case 3: gemv_rows<3>(xp, xs, wp, bp, yp, N, n0, n1, K); break;
      default: gemv_rows<4>(xp, xs, wp, bp, yp, N, n0, n1, K); break;
    }
  });
  return y;
}
#else
bool has_bf16_gemv() { return false; }

torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(false, "gemv_bf16: this build has no AVX512-BF16");
  return x;
}
#endif

}  // namespace pagedserve

namespace pagedserve {

// Structured outputs: logits[rows[i], t] = -inf wherever bit t of bitmask row i is clear (word t / 32, bit
// t % 32, llguidance's layout), in place. logits: [R, V] float32 with contiguous rows; bitmask: int32
// [M, W] contiguous with 32 * W >= V; rows: int64 [M], distinct rows of logits.
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == torch::kFloat32,
              "apply_token_bitmask: logits must be float32 [R, V] with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.is_contiguous() && bitmask.scalar_type() == torch::kInt32,
              "apply_token_bitmask: bitmask must be contiguous int32 [M, W]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt64 && rows.size(0) == bitmask.size(0),
              "apply_token_bitmask: rows must be int64 [M]");
  const int64_t R = logits.size(0), V = logits.size(1), ls = logits.stride(0);
  const int64_t M = bitmask.size(0), W = bitmask.size(1);
  TORCH_CHECK(32 * W >= V, "apply_token_bitmask: the bitmask is narrower than the vocabulary");
  auto rows_c = rows.contiguous();
  const int64_t* rp = rows_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < R, "apply_token_bitmask: row out of range");
  float* x = logits.data_ptr<float>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float* row = x + rp[i] * ls;
      const uint32_t* word = bits + i * W;
      for (int64_t w = 0; w * 32 < V; ++w) {
        const uint32_t m = word[w];
        if (m == 0xFFFFFFFFu) continue;  // all 32 allowed
        const int64_t end = std::min<int64_t>(32, V - w * 32);
        float* chunk = row + w * 32;
        for (int64_t t = 0; t < end; ++t)
          if (!((m >> t) & 1u)) chunk[t] = neg_inf;
      }
    }
  });
}

// claim_ranges run by `threads` std::threads over [0, n), thread `slow` sleeping slow_us per item: the ranges each
// took, (thread, begin, end) in each thread's claiming order (tests: they cover [0, n) once, each owner's from the
// front of its share upward, and a slow thread's share is finished by the others from its back).
std::vector<std::tuple<int64_t, int64_t, int64_t>> claim_ranges_trace(int64_t n, int64_t threads, int64_t slow,
                                                                      int64_t slow_us) {
  TORCH_CHECK(n >= 0 && n < (int64_t{1} << 31) && threads >= 1 && threads <= 64, "claim_ranges_trace: bad n / threads");
  std::vector<ClaimCounter> words(threads);
  std::vector<std::vector<std::tuple<int64_t, int64_t, int64_t>>> got(threads);
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      claim_ranges(words.data(), t, threads, n, [&](int64_t b, int64_t e) {
        got[t].emplace_back(t, b, e);
        if (t == slow) std::this_thread::sleep_for(std::chrono::microseconds(slow_us * (e - b)));
      });
    });
  for (auto& th : pool) th.join();
  std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
  for (const auto& g : got) out.insert(out.end(), g.begin(), g.end());
  return out;
}

}  // namespace pagedserve
