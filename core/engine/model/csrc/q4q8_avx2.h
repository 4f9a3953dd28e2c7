// The q4q8 matmul on CPUs with AVX2 but no AVX-512 (AMD Zen 2 and 3, Intel's client cores): the
// same integer sums and the same float steps per output as the VNNI kernel, so the same bits,
// from eight-lane instructions. See q4q8_avx2.cpp.
#pragma once

#include "q4q8_matmul.h"

// Whether this build has the AVX2 kernel (it is built where AVX-512 VNNI is not).
bool q4q8_avx2_built();

// Each input's two digits joined, 128 high + low, [row][group][32]: what the 8-bit kernel
// multiplies (made once per matmul, before its parallel section).
std::vector<int16_t> q4q8_joined_digits(const QuantizedRows& q);

// out[r * n + 16 t + j] for weight row tiles t in [begin, end), every row of q: the VNNI kernel's
// tile_rows on AVX2 (q4q8_avx2.cpp). joined: q4q8_joined_digits(q) for 8-bit codes, else unused.
void q4q8_avx2_tiles(const QuantizedRows& q, const int16_t* joined, const uint8_t* packed, const at::Half* dm,
                     int64_t n, float* out, int bits, int64_t begin, int64_t end);
