// Fused elementwise work of a Llama decoder layer on the CPU, one pass over memory each:
//   rms_norm, fused_add_rms_norm (residual add + norm, in place), rotary_write_kv (rotary on q and k in
//   place + K/V scattered into the paged cache), silu_and_mul (SwiGLU).
// Each reproduces the reference (HF transformers) rounding points in bf16: values are rounded to the
// storage dtype wherever the reference materialises a bf16 tensor; arithmetic is float32.
#include <ATen/Parallel.h>

#include <cmath>

#include "common.h"

namespace pagedserve {
namespace {

// Rows per parallel task: enough work that waking the second thread pays off.
inline int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

template <typename S>
inline void norm_row(const S* x, const S* w, S* out, int64_t H, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) {
    const float v = Elem<S>::load(x[i]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) {
    // HF: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)
    out[i] = Elem<S>::store(Elem<S>::load(w[i]) * round_to<S>(Elem<S>::load(x[i]) * r));
  }
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, ": x must be [T, H] with contiguous rows");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1), what, ": weight must be [H]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), what, ": weight dtype must match x");
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, w, "rms_norm");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t T = x.size(0), H = x.size(1), xs = x.stride(0);
  dispatch_float_bf16(x, "rms_norm", [&]<typename S>() {
    const S* xp = ptr<S>(x);
    const S* wp = ptr<S>(w);
    S* op = ptr<S>(out);
    at::parallel_for(0, T, grain_rows(H), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) norm_row<S>(xp + t * xs, wp, op + t * H, H, static_cast<float>(eps));
    });
  });
  return out;
}

// residual <- x + residual (rounded to the dtype), x <- rms_norm(residual) * w. Both in place.
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
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
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) rr[i] = Elem<S>::store(Elem<S>::load(xr[i]) + Elem<S>::load(rr[i]));
        norm_row<S>(rr, wp, xr, H, static_cast<float>(eps));
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
  dispatch_float_bf16(qkv, "rotary_write_kv", [&]<typename S>() {
    S* base = ptr<S>(qkv);
    S* kc = ptr<S>(k_cache);
    S* vc = ptr<S>(v_cache);
    at::parallel_for(0, T, grain_rows((H + 2 * KVH) * D), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        S* tok = base + t * qs;
        const float* c = cp + t * half;
        const float* s = sp + t * half;
        for (int64_t h = 0; h < H + KVH; ++h) {  // q heads, then k heads: they are adjacent in qkv
          S* x = tok + h * D;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = Elem<S>::load(x[i]), x2 = Elem<S>::load(x[i + half]);
            x[i] = Elem<S>::store(x1 * c[i] - x2 * s[i]);
            x[i + half] = Elem<S>::store(x2 * c[i] + x1 * s[i]);
          }
        }
        std::memcpy(kc + slots[t] * row, tok + H * D, row * sizeof(S));
        std::memcpy(vc + slots[t] * row, tok + (H + KVH) * D, row * sizeof(S));
      }
    });
  });
}

// gate_up: [T, 2 * I] -> [T, I]: silu(gate) * up, each rounded to the dtype as the reference does.
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_and_mul: input must be [T, 2 * I] with contiguous rows");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, gs = gate_up.stride(0);
  auto out = torch::empty({T, I}, gate_up.options());
  dispatch_float_bf16(gate_up, "silu_and_mul", [&]<typename S>() {
    const S* in = ptr<S>(gate_up);
    S* op = ptr<S>(out);
    at::parallel_for(0, T, grain_rows(2 * I), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const S* g = in + t * gs;
        const S* u = g + I;
        S* o = op + t * I;
#pragma omp simd
        for (int64_t i = 0; i < I; ++i) {
          const float x = Elem<S>::load(g[i]);
          // Clamped so exp stays finite (the kernels are built with -ffast-math): silu(x) ~ -0 there anyway.
          const float act = round_to<S>(x / (1.f + expf(std::min(-x, 80.f))));
          o[i] = Elem<S>::store(act * Elem<S>::load(u[i]));
        }
      }
    });
  });
  return out;
}

}  // namespace pagedserve
