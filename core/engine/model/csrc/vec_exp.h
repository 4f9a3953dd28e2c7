// e^x on 16 floats at once (AVX-512), for the decode loops' softmax and SwiGLU.
#pragma once

// Cephes' expf: x = n ln 2 + r (ln 2 in two parts), a degree-6 polynomial in r, times 2^n; shared
// with the eight-float exp256 (simd256.h), which must give the same bits
namespace vec_exp {
constexpr float kLimit = 88.3762626647949f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kFirst = 1.9875691500e-4f;
constexpr float kPolynomial[] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace vec_exp

#ifdef __AVX512F__
#include <immintrin.h>

// e^x to ~1 ulp
inline __m512 exp512(__m512 x) {
  using namespace vec_exp;
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(kLimit)), _mm512_set1_ps(-kLimit));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 y = _mm512_set1_ps(kFirst);
  for (const float c : kPolynomial) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}
#endif

