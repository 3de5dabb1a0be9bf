// Which AVX-512 ops share the vdpbf16ps pipes (the thirty-ninth part, for the bf16 prefill attention's softmax):
// each op alone (12 independent chains) and interleaved 1:1 with a vdpbf16ps, in core cycles per op (the TSC ticks
// scaled by 0.715, this Zen 4's 2.6 GHz TSC against its 3.63 GHz clock: edit kTsc for another CPU).
//   g++ -O2 -march=native -o /tmp/port_mix benchmarks/avx512/port_mix.cpp && /tmp/port_mix
// An op that runs beside the dot product costs max(1, its own rate) with one; one on the same pipes costs ~2.
#include <immintrin.h>
#include <cstdio>
#include <x86intrin.h>
#define N 12
constexpr double kTsc = 0.715;
template <int KIND, bool MIX>
__attribute__((noinline)) double run(long iters, float seed) {
  __m512 f[N], g[N];
  for (int i = 0; i < N; ++i) g[i] = _mm512_set1_ps(seed);
  const __m512bh w2 = (__m512bh)_mm512_set1_epi32(0x3f803f80 * (int)seed);
  for (int i = 0; i < N; ++i) f[i] = _mm512_set1_ps(seed + i);
  const __m512 c = _mm512_set1_ps(seed * 1e-9f), one = _mm512_set1_ps(1.0f);
  const __m512bh w = (__m512bh)_mm512_set1_epi32(0);
  unsigned long t0 = __rdtsc();
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < N; ++i) {
      __m512 x = f[i];
      if (KIND == 0) x = _mm512_add_ps(x, c);
      if (KIND == 1) x = _mm512_sub_ps(x, c);
      if (KIND == 2) x = _mm512_max_ps(x, c);
      if (KIND == 4) x = _mm512_fmadd_ps(x, one, c);
      if (KIND == 5) x = _mm512_scalef_ps(x, c);
      if (KIND == 6) x = _mm512_reduce_ps(x, 0);
      if (KIND == 7) x = _mm512_dpbf16_ps(x, w, w);
      if (KIND == 8) x = _mm512_roundscale_ps(x, 0);
      if (KIND == 9) x = (__m512)_mm512_add_epi32((__m512i)x, (__m512i)c);
      if (KIND == 10) x = (__m512)_mm512_permutexvar_epi16((__m512i)c, (__m512i)x);
      if (KIND == 11) x = (__m512)_mm512_cvtne2ps_pbh(x, c);
      if (KIND == 12) x = (__m512)_mm512_permutexvar_ps((__m512i)c, x);
      if (KIND == 13) x = _mm512_unpacklo_ps(x, c);
      if (KIND == 14) x = (__m512)_mm512_cvtps_epi32(x);
      if (KIND == 15) x = (__m512)_mm512_ternarylogic_epi32((__m512i)x, (__m512i)c, (__m512i)c, 0x96);
      f[i] = x;
      if (MIX) g[i] = _mm512_dpbf16_ps(g[i], w2, w2);
    }
  }
  unsigned long t1 = __rdtsc();
  float s = 0; for (int i = 0; i < N; ++i) s += f[i][0] + g[i][1];
  if (s == 12345.f) printf("!");
  return double(t1 - t0) / iters / N / kTsc;  // core cycles per op
}
int main(int argc, char**) {
  const long n = 10000000;
  const char* names[] = {"add","sub","max","(mul)","fma","scalef","reduce","dpbf16","roundscale","paddd","permw","cvtne2","permps","unpcklps","cvtps2dq","ternlog"};
#define K(k) printf("%-10s %.2f alone, %.2f with a dpbf16 each\n", names[k], run<k, false>(n, argc * 1.0f), run<k, true>(n, argc * 1.0f));
  K(0)K(1)K(2)K(4)K(5)K(6)K(7)K(8)K(9)K(10)K(11)K(12)K(13)K(14)K(15)
}
