// A prototype that did not pay (issue 17, twenty-fifth part), kept to be measured again: the one-row bf16 GEMV with W
// as the AMX A tile (16 weight rows x 32 k; x as the B tile, one column per row of x) instead of as the B tile, so
// that an A tile row is one row's 32-weight Q4_0 / Q4_1 block and its bf16 values can come from a per-row table of
// the block's 16 values (one fma over 0..15, one vcvtne2ps2bf16 for two rows) looked up with vpermw, instead of
// widening and rounding every weight. The packed layout is quant_pack's (byte-planar quants), transposed to rows in
// registers (two vpermt2b stages); the nibbles become word indices with vpermb + gf2p8affineqb.
//
// Same bits as quant_linear_bf16's AMX route (TDPBF16PS sums a row's 32 products in the same order whichever operand
// the weights are), checked by gemv_w_as_a.py on every Q4_1 matmul of the bundled model. Slower: see the README.
//
//   g++ -O2 -march=native -shared -fPIC -o /tmp/gemv_w_as_a.so benchmarks/amx/gemv_w_as_a.cpp
//   .venv/bin/python benchmarks/amx/gemv_w_as_a.py /tmp/gemv_w_as_a.so
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace {

struct TileCfg {
  uint8_t palette, start;
  uint8_t res[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

alignas(64) uint8_t kStage[2][64];  // stage 1: rows 0-7 / 8-15 of quants j 0..7 (or 8..15) at 8 r + j
alignas(64) uint8_t kS2[2][64];     // stage 2: rows 0-3 / 4-7 of an 8-row half, all 16 j, at 16 r + j
alignas(64) uint8_t kExp[4][64];    // row r of 4 -> words k = 0..31 holding byte k % 16 (high bytes zeroed)

void init_consts() {
  for (int half = 0; half < 2; ++half)
    for (int rr = 0; rr < 8; ++rr)
      for (int j = 0; j < 8; ++j) kStage[half][8 * rr + j] = j < 4 ? 16 * j + half * 8 + rr : 64 + 16 * (j - 4) + half * 8 + rr;
  for (int g = 0; g < 2; ++g)
    for (int rr = 0; rr < 4; ++rr)
      for (int j = 0; j < 16; ++j) kS2[g][16 * rr + j] = j < 8 ? 8 * (4 * g + rr) + j : 64 + 8 * (4 * g + rr) + (j - 8);
  for (int rr = 0; rr < 4; ++rr)
    for (int k = 0; k < 32; ++k) kExp[rr][2 * k] = 16 * rr + (k % 16), kExp[rr][2 * k + 1] = 0;
}

// gf2p8affineqb matrices: the low nibble of each byte (words 0-15), the high nibble shifted down (words 16-31).
__m512i gf_matrix() {
  uint64_t lo = 0, hi = 0;
  for (int i = 0; i < 4; ++i) {
    lo |= uint64_t(1u << i) << (8 * (7 - i));
    hi |= uint64_t(1u << (i + 4)) << (8 * (7 - i));
  }
  return _mm512_set_epi64(hi, hi, hi, hi, lo, lo, lo, lo);
}

// One 32-k step of one panel (16 rows; T = 3: Q4_1 d * q + m, T = 2: Q4_0 d * (q - 8)) into A tile rows out[16][32].
template <int T>
inline void widen_rows(const uint8_t* pb, uint16_t* out, __m512i gfm, __m512 iota) {
  alignas(64) float D[16], C[16];
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb)));
  _mm512_store_ps(D, d);
  if (T == 3) {
    _mm512_store_ps(C, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 32))));
  } else {
    _mm512_store_ps(C, _mm512_mul_ps(d, _mm512_set1_ps(-8.f)));
  }
  const float* Dp = D;
  const float* Cp = C;
  __asm__("" : "+r"(Dp), "+r"(Cp) : : "memory");  // broadcasts from memory, not permutes of the registers
  const uint8_t* qs = pb + (T == 3 ? 64 : 32);
  const __m512i z0 = _mm512_loadu_si512(qs), z1 = _mm512_loadu_si512(qs + 64);
  const __m512i z2 = _mm512_loadu_si512(qs + 128), z3 = _mm512_loadu_si512(qs + 192);
  const __m512i st0 = _mm512_load_si512(kStage[0]), st1 = _mm512_load_si512(kStage[1]);
  const __m512i t0 = _mm512_permutex2var_epi8(z0, st0, z1), t1 = _mm512_permutex2var_epi8(z0, st1, z1);
  const __m512i t2 = _mm512_permutex2var_epi8(z2, st0, z3), t3 = _mm512_permutex2var_epi8(z2, st1, z3);
  const __m512i u0 = _mm512_load_si512(kS2[0]), u1 = _mm512_load_si512(kS2[1]);
  const __m512i R[4] = {_mm512_permutex2var_epi8(t0, u0, t2), _mm512_permutex2var_epi8(t0, u1, t2),
                        _mm512_permutex2var_epi8(t1, u0, t3), _mm512_permutex2var_epi8(t1, u1, t3)};
  constexpr __mmask64 even = 0x5555555555555555ull;
#pragma GCC unroll 8
  for (int r = 0; r < 16; r += 2) {
    const __m512 f0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(Dp[r]), _mm512_set1_ps(Cp[r]));
    const __m512 f1 = _mm512_fmadd_ps(iota, _mm512_set1_ps(Dp[r + 1]), _mm512_set1_ps(Cp[r + 1]));
    const __m512i tb = (__m512i)_mm512_cvtne2ps_pbh(f1, f0);  // row r's table in words 0-15, row r + 1's in 16-31
    const __m512i w0 = _mm512_maskz_permutexvar_epi8(even, _mm512_load_si512(kExp[r & 3]), R[r >> 2]);
    const __m512i w1 = _mm512_maskz_permutexvar_epi8(even, _mm512_load_si512(kExp[(r + 1) & 3]), R[r >> 2]);
    _mm512_store_si512(out + 32 * r, _mm512_permutexvar_epi16(_mm512_gf2p8affine_epi64_epi8(w0, gfm, 0), tb));
    _mm512_store_si512(out + 32 * (r + 1), _mm512_permutexvar_epi16(_mm512_gf2p8affine_epi64_epi8(w1, gfm, 0x10), tb));
  }
}

template <int T>
void gemv(const uint16_t* x, int M, const uint8_t* w, int64_t N, int64_t K, float* y) {
  const int64_t bb = T == 3 ? 20 : 18, pstride = (K / 32) * 16 * bb, np = (N + 15) / 16;
  const __m512i gfm = gf_matrix();
  const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  static uint16_t xv[16 * 8192] __attribute__((aligned(64)));  // x as B tiles: [k / 2][M][2]
  for (int64_t kp = 0; kp < K / 2; ++kp)
    for (int n = 0; n < M; ++n) xv[(kp * M + n) * 2] = x[n * K + 2 * kp], xv[(kp * M + n) * 2 + 1] = x[n * K + 2 * kp + 1];
  TileCfg c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t : {0, 1}) c.rows[t] = 16, c.colsb[t] = 4 * M;  // C: 16 weight rows x M
  for (int t : {2, 3}) c.rows[t] = 16, c.colsb[t] = 64;     // A: 16 weight rows x 32 k
  c.rows[4] = 16, c.colsb[4] = 4 * M;                       // B: 16 k pairs x M
  _tile_loadconfig(&c);
  alignas(64) uint16_t a[2][2][16 * 32];
  alignas(64) float acc[2][16 * 16];
  for (int64_t p = 0; p < np; p += 2) {  // two panels at a time, a step widened ahead
    const int P = p + 1 < np ? 2 : 1;
    const uint8_t* panel = w + p * pstride;
    _tile_zero(0);
    _tile_zero(1);
    for (int q = 0; q < P; ++q) widen_rows<T>(panel + q * pstride, a[0][q], gfm, iota);
    for (int64_t b = 0; b < K / 32; ++b) {
      if (b + 1 < K / 32)
        for (int q = 0; q < P; ++q) widen_rows<T>(panel + q * pstride + (b + 1) * 16 * bb, a[(b + 1) & 1][q], gfm, iota);
      _tile_loadd(4, xv + b * 16 * M * 2, 4 * M);
      _tile_loadd(2, a[b & 1][0], 64);
      _tile_dpbf16ps(0, 2, 4);
      if (P > 1) {
        _tile_loadd(3, a[b & 1][1], 64);
        _tile_dpbf16ps(1, 3, 4);
      }
    }
    _tile_stored(0, acc[0], 4 * M);
    if (P > 1) _tile_stored(1, acc[1], 4 * M);
    for (int q = 0; q < P; ++q)
      for (int r = 0; r < 16 && (p + q) * 16 + r < N; ++r)
        for (int n = 0; n < M; ++n) y[n * N + (p + q) * 16 + r] = acc[q][r * M + n];
  }
  _tile_release();
}

}  // namespace

extern "C" int amx_init() {
  init_consts();
  return static_cast<int>(syscall(SYS_arch_prctl, 0x1023, 18));
}

// y [M, N] float32 = x [M, K] bf16 . W^T, W quant_pack's Q4_1 (type 3) or Q4_0 (type 2) panels; M <= 16, K <= 16,384.
extern "C" void gemv_rows(int type, const uint16_t* x, int M, const uint8_t* w, int64_t N, int64_t K, float* y) {
  if (type == 3) {
    gemv<3>(x, M, w, N, K, y);
  } else {
    gemv<2>(x, M, w, N, K, y);
  }
}
