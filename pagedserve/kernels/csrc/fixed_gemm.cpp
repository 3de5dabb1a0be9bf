// The batch-invariant matmul: y = x @ w.T (+ bias), where every output y[m, n] is ONE float32 FMA chain
//   acc = 0; for k = 0 .. K-1: acc = fma(x[m, k], w[n, k], acc);  y[m, n] = acc (+ bias[n])
// whatever M is, whichever row m is, and however the work is split over threads. So a row's result does
// not depend on what else is in the batch: bit for bit (the strict `batch_invariant` mode, and the LM
// head's float32 logits). Library GEMMs do not promise that: their blocking and kernel choice (a GEMV
// for one row, split K for some shapes) change with M.
//
// Layout: the weight is packed once ([ceil(N / 16), K, 16], zero-padded columns, float32 or bf16 kept as
// it is) so that 16 output columns are two AVX2 vectors and a register tile is 6 rows x 16 columns
// (12 accumulators). Rows left over (M % 6) run the same tile with fewer rows: each output's chain is
// the same sequence of FMAs, so identical bits. Threads split the column panels; an output is computed
// by one thread from k = 0 to K-1. The FMAs are AVX2 intrinsics (opaque to -ffast-math's
// reassociation); without AVX2/FMA, std::fma gives the same correctly rounded steps.
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDSERVE_FIXED_AVX2 1
#endif

namespace pagedserve {
namespace {

constexpr int64_t kNR = 16;  // output columns per packed panel
constexpr int64_t kMR = 6;   // rows per register tile
constexpr int64_t kMB = 48;  // rows per cache block (x rows reused across every panel of a thread)

#ifdef PAGEDSERVE_FIXED_AVX2
inline __m256 wload8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 wload8(const uint16_t* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif

// acc[r * 16 + j] = chain over k of x[r, k] * panel[k, j] for R rows of x (float32, row stride xs).
template <int R, typename WT>
inline void tile(const float* x, int64_t xs, const WT* panel, int64_t K, float* acc) {
#ifdef PAGEDSERVE_FIXED_AVX2
  __m256 c0[R], c1[R];
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = wload8(panel + k * kNR), w1 = wload8(panel + k * kNR + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * xs + k);
      c0[r] = _mm256_fmadd_ps(a, w0, c0[r]);
      c1[r] = _mm256_fmadd_ps(a, w1, c1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc + r * kNR, c0[r]);
    _mm256_storeu_ps(acc + r * kNR + 8, c1[r]);
  }
#else
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < kNR; ++j) acc[r * kNR + j] = 0.f;
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < kNR; ++j)
        acc[r * kNR + j] = std::fma(x[r * xs + k], Elem<WT>::load(panel[k * kNR + j]), acc[r * kNR + j]);
#endif
}

template <typename WT>
inline void tile_rows(int64_t R, const float* x, int64_t xs, const WT* panel, int64_t K, float* acc) {
  switch (R) {
    case 1: tile<1>(x, xs, panel, K, acc); break;
    case 2: tile<2>(x, xs, panel, K, acc); break;
    case 3: tile<3>(x, xs, panel, K, acc); break;
    case 4: tile<4>(x, xs, panel, K, acc); break;
    case 5: tile<5>(x, xs, panel, K, acc); break;
    default: tile<6>(x, xs, panel, K, acc); break;
  }
}

template <typename WT, typename OT>
void fixed_gemm(const float* x, int64_t xs, const WT* wp, const float* bias, OT* y, int64_t M, int64_t N,
                int64_t K) {
  const int64_t panels = (N + kNR - 1) / kNR;
  // A panel's rows of one row block: each tile's chains, then the tile's outputs (with the bias).
  const auto panel_rows = [&](int64_t p, int64_t m0, int64_t mb) {
    alignas(64) float acc[kMR * kNR];
    const WT* panel = wp + p * K * kNR;
    const int64_t n0 = p * kNR, nn = std::min(kNR, N - n0);
    for (int64_t r0 = 0; r0 < mb; r0 += kMR) {
      const int64_t R = std::min(kMR, mb - r0);
      tile_rows(R, x + (m0 + r0) * xs, xs, panel, K, acc);
      for (int64_t r = 0; r < R; ++r) {
        OT* out = y + (m0 + r0 + r) * N + n0;
        for (int64_t j = 0; j < nn; ++j) {
          const float v = bias ? acc[r * kNR + j] + bias[n0 + j] : acc[r * kNR + j];
          out[j] = Elem<OT>::store(v);
        }
      }
    }
  };
  // Few rows: the matmul reads the weight once (memory-bound): small panel ranges per task, each a stream. Many rows:
  // (row block, panel) items row block by row block (each thread's x block hot in its L2), taken by whichever thread
  // is free (parallel_claims: a slower core takes fewer). The split never changes a result.
  if (M <= 8) {
    at::parallel_for(0, panels, 4, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) panel_rows(p, 0, M);
    });
    return;
  }
  const int64_t blocks = (M + kMB - 1) / kMB;
  parallel_claims(blocks * panels, [&](const auto& next) {
    for (int64_t item = next(); item >= 0; item = next()) {
      const int64_t m0 = item / panels * kMB;
      panel_rows(item % panels, m0, std::min(kMB, M - m0));
    }
  });
}

}  // namespace

// w: [N, K] float32 or bf16 -> packed [ceil(N / 16), K, 16] of the same dtype (the columns past N are 0).
torch::Tensor fixed_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16),
              "fixed_pack: w must be a float32 or bfloat16 [N, K] matrix");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kNR - 1) / kNR;
  auto padded = torch::zeros({panels * kNR, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({panels, kNR, K}).transpose(1, 2).contiguous();
}

// x: [M, K] float32 or bf16 (contiguous rows, any row stride); packed: fixed_pack of a [N, K] weight;
// bias: [N] (any float dtype; added in float32). Returns [M, N] in out_dtype (float32 or bf16: rounded
// to nearest even once, at the end).
torch::Tensor fixed_linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias,
                           c10::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "fixed_linear: x must be [M, K] with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kNR && packed.size(1) == x.size(1) &&
                  N >= 1 && N <= packed.size(0) * kNR && N > (packed.size(0) - 1) * kNR,
              "fixed_linear: packed weight does not match x or N (use fixed_pack)");
  TORCH_CHECK(out_dtype == torch::kFloat32 || out_dtype == torch::kBFloat16,
              "fixed_linear: out_dtype must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1);
  auto xf = x.scalar_type() == torch::kFloat32 ? x : x.to(torch::kFloat32);
  torch::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "fixed_linear: bias must have N elements");
    bf = bias->to(torch::kFloat32).contiguous();
  }
  auto y = matmul_output(M, N, x.options().dtype(out_dtype));
  if (M == 0) return y;
  const float* xp = xf.data_ptr<float>();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  dispatch_float_bf16(packed, "fixed_linear", [&]<typename WT>() {
    dispatch_float_bf16(y, "fixed_linear", [&]<typename OT>() {
      fixed_gemm<WT, OT>(xp, xf.stride(0), ptr<WT>(packed), bp, ptr<OT>(y), M, N, K);
    });
  });
  return y;
}

}  // namespace pagedserve
