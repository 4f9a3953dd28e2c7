// Eight-float (AVX2 + FMA + F16C) counterparts of the AVX-512 steps the kernels use, written so
// that each gives the AVX-512 step's bits: a sixteen-float vector is held as two halves (lanes
// 0-7, 8-15), each lane sees the same operations in the same order, and the reductions follow
// GCC's _mm512_reduce_add_ps tree. CPUs with AVX2 but no AVX-512 (AMD Zen 2 and 3, Intel's
// client cores) take these paths.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>

#include "vec_exp.h"
#define LOOPSTACK_SIMD256 1

// _mm512_reduce_add_ps of the vector whose lanes 0-7 are lo and 8-15 are hi, in GCC's order:
// halves, then 128-bit quarters, then pairs {0, 2} and {1, 3}, then those two
inline float reduce_add16(__m256 lo, __m256 hi) {
  const __m256 halves = _mm256_add_ps(hi, lo);
  const __m128 quarters = _mm_add_ps(_mm256_extractf128_ps(halves, 1), _mm256_castps256_ps128(halves));
  const __m128 pairs = _mm_add_ps(quarters, _mm_shuffle_ps(quarters, quarters, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(pairs) + _mm_cvtss_f32(_mm_shuffle_ps(pairs, pairs, _MM_SHUFFLE(1, 1, 1, 1)));
}

inline float reduce_max16(__m256 lo, __m256 hi) {  // max is exact in any order
  const __m256 halves = _mm256_max_ps(hi, lo);
  __m128 m = _mm_max_ps(_mm256_extractf128_ps(halves, 1), _mm256_castps256_ps128(halves));
  m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
  return std::max(_mm_cvtss_f32(m), _mm_cvtss_f32(_mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 1, 1, 1))));
}

// y * 2^n for integral n in [-128, 128] (as _mm512_scalef_ps there): two exact power-of-two
// factors, so a result in the subnormal range is rounded once, as scalef rounds it
inline __m256 scale_by_power_of_two(__m256 y, __m256 n) {
  const __m256i whole = _mm256_cvtps_epi32(n);
  const __m256i first = _mm256_srai_epi32(whole, 1), second = _mm256_sub_epi32(whole, first);
  auto power = [](__m256i e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); };
  return _mm256_mul_ps(_mm256_mul_ps(y, power(first)), power(second));
}

// exp512 (vec_exp.h) on eight floats, step for step
inline __m256 exp256(__m256 x) {
  using namespace vec_exp;
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(kLimit)), _mm256_set1_ps(-kLimit));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 y = _mm256_set1_ps(kFirst);
  for (const float c : kPolynomial) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  return scale_by_power_of_two(y, n);
}
#endif
