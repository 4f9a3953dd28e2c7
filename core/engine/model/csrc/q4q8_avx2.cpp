// The q4q8 matmul on AVX2 (see q4q8_matmul.cpp for the formats and the VNNI kernel).
//
// AVX2 has no vpdpbusd. Its byte product, vpmaddubsw, multiplies unsigned by signed bytes and adds
// adjacent pairs into signed 16-bit lanes, saturating; vpmaddwd then adds pairs of those into
// 32-bit lanes with a factor. Neither saturates here: a 4-bit code is at most 15 and a digit at
// most 127 in size, so a pair is at most 3,810 and a group's 16 products per 16-bit lane at most
// 30,480. So a group's sum(code * high) and sum(code * low) are each eight vpmaddubsw added in
// 16 bits, and vpmaddwd by 128 and by 1 gives 128 * sum(code * high) + sum(code * low) in 32 bits:
// the integer the VNNI kernel gets, exactly. 8-bit codes (the head) take vpmaddwd of the codes
// widened to 16 bits and the digits joined (half_tile_rows_q8). The float steps per output are the
// VNNI kernel's (cvt, d * s, two FMAs, in that order), so every output has its bits.
//
// A ymm register holds 8 of a tile's 16 rows: the tile runs as two halves, rows 0-7 then 8-15,
// the second half's codes from cache. A group's codes are unpacked once into a small buffer and
// read from it for every input row; a single input row takes the whole tile in one pass instead.
#include "q4q8_avx2.h"

#include "simd256.h"
#include "spin_pool.h"

#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using q4q8::kGroup, q4q8::kTile;

#ifdef LOOPSTACK_SIMD256
// Ask the cache for a group's codes `distance` bytes ahead, and for the same group's scales (64
// bytes a group) as far ahead in theirs, as the VNNI kernel does
template <int GroupBytes>
inline void prefetch_group(const uint8_t* codes, const at::Half* scales, int64_t distance) {
#pragma GCC unroll 8
  for (int line = 0; line < GroupBytes / 64; ++line) _mm_prefetch(reinterpret_cast<const char*>(codes + distance + 64 * line), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(scales) + distance * 64 / GroupBytes, _MM_HINT_T0);
}

// The 8 outputs of half `half` of row tile `w` (rows 8 half .. 8 half + 7) for R input rows from
// r0: out[i * out_stride + j].
template <int R>
void half_tile_rows(const uint8_t* w, const at::Half* dm, const QuantizedRows& q, int64_t r0, int64_t groups,
                    int half, float* out, int64_t out_stride) {
  constexpr int kGroupBytes = kTile * kGroup / 2;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  alignas(32) uint8_t codes[8][32];  // [j]: inputs 4j .. 4j + 3 of the half's rows
  __m256 acc[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t distance = r0 == 0 && half == 0 ? q4q8::prefetch_bytes() : 0;  // later passes: in cache
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * kGroupBytes;
    if (distance > 0) prefetch_group<kGroupBytes>(wg, dm + g * 32, distance);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {  // chunk c: inputs 8c .. 8c + 3 low nibbles, 8c + 4 .. 8c + 7 high
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + c * 64 + 32 * half));
      _mm256_store_si256(reinterpret_cast<__m256i*>(codes[2 * c]), _mm256_and_si256(bytes, nibble));
      _mm256_store_si256(reinterpret_cast<__m256i*>(codes[2 * c + 1]), _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble));
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + g * 32 + 8 * half)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + g * 32 + 16 + 8 * half)));
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const int64_t row = r0 + i;
      const int32_t* x = reinterpret_cast<const int32_t*>(q.codes.data() + (row * groups + g) * 2 * kGroup);
      auto code = [&](int j) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(codes[j])); };
      __m256i high = _mm256_setzero_si256(), low = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        high = _mm256_add_epi16(high, _mm256_maddubs_epi16(code(j), _mm256_set1_epi32(x[j])));
        low = _mm256_add_epi16(low, _mm256_maddubs_epi16(code(j), _mm256_set1_epi32(x[8 + j])));
      }
      // 128 * sum(code * high) + sum(code * low), per row of the half
      const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(high, _mm256_set1_epi16(128)), _mm256_madd_epi16(low, _mm256_set1_epi16(1)));
      const float* s = q.scales.data() + (row * groups + g) * 2;  // (s, sum(x))
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_set1_ps(s[0])), acc[i]);
      acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(s[1]), acc[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(out + i * out_stride, acc[i]);
}

// One input row against a whole tile of 4-bit codes in one pass (a batch-1 decode step's every
// projection): each broadcast input serves both halves and the codes stay in registers, where
// half_tile_rows unpacks them through its buffer for the rows to share. The same sums and float
// steps, so the same bits.
void tile_one_row_q4(const uint8_t* w, const at::Half* dm, const QuantizedRows& q, int64_t row, int64_t groups,
                     float* out) {
  constexpr int kGroupBytes = kTile * kGroup / 2;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  const int64_t distance = q4q8::prefetch_bytes();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * kGroupBytes;
    if (distance > 0) prefetch_group<kGroupBytes>(wg, dm + g * 32, distance);
    const int32_t* x = reinterpret_cast<const int32_t*>(q.codes.data() + (row * groups + g) * 2 * kGroup);
    __m256i high[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, low[2] = {high[0], high[1]};
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {  // chunk c: inputs 8c .. 8c + 3 low nibbles, 8c + 4 .. 8c + 7 high
      const __m256i high_first = _mm256_set1_epi32(x[2 * c]), high_second = _mm256_set1_epi32(x[2 * c + 1]);
      const __m256i low_first = _mm256_set1_epi32(x[8 + 2 * c]), low_second = _mm256_set1_epi32(x[8 + 2 * c + 1]);
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + c * 64 + 32 * half));
        const __m256i first = _mm256_and_si256(bytes, nibble), second = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
        high[half] = _mm256_add_epi16(high[half], _mm256_add_epi16(_mm256_maddubs_epi16(first, high_first), _mm256_maddubs_epi16(second, high_second)));
        low[half] = _mm256_add_epi16(low[half], _mm256_add_epi16(_mm256_maddubs_epi16(first, low_first), _mm256_maddubs_epi16(second, low_second)));
      }
    }
    const float* s = q.scales.data() + (row * groups + g) * 2;  // (s, sum(x))
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(high[half], _mm256_set1_epi16(128)), _mm256_madd_epi16(low[half], _mm256_set1_epi16(1)));
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + g * 32 + 8 * half)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + g * 32 + 16 + 8 * half)));
      acc[half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_set1_ps(s[0])), acc[half]);
      acc[half] = _mm256_fmadd_ps(m, _mm256_set1_ps(s[1]), acc[half]);
    }
  }
  _mm256_storeu_ps(out, acc[0]);
  _mm256_storeu_ps(out + 8, acc[1]);
}

// 8-bit codes (the head) by vpmaddwd instead: the codes widened to 16 bits, each input's two
// digits joined into one 16-bit value, 128 high + low (at most 16,320 in size), so one instruction
// multiplies 2 inputs of 4 rows at full precision, half the multiplies of the nibbles' way. The
// integer is the same: sum(code * (128 high + low)), at most 255 * 16,320 * 32 in size.
// joined: q4q8_joined_digits(q).
template <int R>
void half_tile_rows_q8(const uint8_t* w, const at::Half* dm, const int16_t* joined, const QuantizedRows& q, int64_t r0,
                       int64_t groups, int half, float* out, int64_t out_stride) {
  constexpr int kGroupBytes = kTile * kGroup;
  alignas(32) int16_t codes[16][16];  // [2c + p]: chunk c's rows 8 half + 4p .. + 3, each (4c, 4c+1), (4c+2, 4c+3)
  const __m256i row_order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);  // undoes hadd's interleave
  __m256 acc[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t distance = r0 == 0 && half == 0 ? q4q8::prefetch_bytes() : 0;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * kGroupBytes;
    if (distance > 0) prefetch_group<kGroupBytes>(wg, dm + g * 32, distance);
#pragma GCC unroll 16
    for (int v = 0; v < 16; ++v) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + (v / 2) * 64 + 32 * half + 16 * (v % 2)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(codes[v]), _mm256_cvtepu8_epi16(bytes));
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + g * 32 + 8 * half)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + g * 32 + 16 + 8 * half)));
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const int64_t row = r0 + i;
      const int64_t* x = reinterpret_cast<const int64_t*>(joined + (row * groups + g) * kGroup);  // inputs 4c .. 4c + 3
      __m256i first = _mm256_setzero_si256(), second = _mm256_setzero_si256();  // rows 0-3, 4-7 of the half
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m256i xs = _mm256_set1_epi64x(x[c]);
        first = _mm256_add_epi32(first, _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(codes[2 * c])), xs));
        second = _mm256_add_epi32(second, _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(codes[2 * c + 1])), xs));
      }
      const __m256i sums = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(first, second), row_order);
      const float* s = q.scales.data() + (row * groups + g) * 2;  // (s, sum(x))
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_set1_ps(s[0])), acc[i]);
      acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(s[1]), acc[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(out + i * out_stride, acc[i]);
}

// pass(rows, r) over m input rows in passes of at most 4 (rows: std::integral_constant<int, R>; 8-row
// passes measured no faster)
template <class Pass>
void in_row_passes(int64_t m, Pass&& pass) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) pass(std::integral_constant<int, 4>{}, r);
  switch (m - r) {
    case 3: pass(std::integral_constant<int, 3>{}, r); break;
    case 2: pass(std::integral_constant<int, 2>{}, r); break;
    case 1: pass(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

void tile_all_rows_q8(const QuantizedRows& q, const int16_t* joined, const uint8_t* wt, const at::Half* dt,
                      int64_t groups, float* ot, int64_t n) {
  for (int half = 0; half < 2; ++half)
    in_row_passes(q.rows, [&](auto rows, int64_t r) {
      half_tile_rows_q8<decltype(rows)::value>(wt, dt, joined, q, r, groups, half, ot + 8 * half + r * n, n);
    });
}

void tile_all_rows_q4(const QuantizedRows& q, const uint8_t* wt, const at::Half* dt, int64_t groups, float* ot,
                      int64_t n) {
  for (int half = 0; half < 2; ++half)
    in_row_passes(q.rows, [&](auto rows, int64_t r) {
      half_tile_rows<decltype(rows)::value>(wt, dt, q, r, groups, half, ot + 8 * half + r * n, n);
    });
}
#endif

}  // namespace

std::vector<int16_t> q4q8_joined_digits(const QuantizedRows& q) {
  std::vector<int16_t> joined(q.rows * q.k);
  for (int64_t rg = 0; rg < q.rows * (q.k / kGroup); ++rg) {
    const int8_t* high = q.codes.data() + rg * 2 * kGroup;
    for (int64_t i = 0; i < kGroup; ++i) joined[rg * kGroup + i] = static_cast<int16_t>(high[i] * 128 + high[kGroup + i]);
  }
  return joined;
}

bool q4q8_avx2_built() {
#ifdef LOOPSTACK_SIMD256
  return true;
#else
  return false;
#endif
}

void q4q8_avx2_tiles(const QuantizedRows& q, const int16_t* joined, const uint8_t* packed, const at::Half* dm,
                     int64_t n, float* out, int bits, int64_t begin, int64_t end) {
#ifdef LOOPSTACK_SIMD256
  const int64_t groups = q.k / kGroup, tile_bytes = groups * kTile * kGroup * bits / 8;
  for (int64_t t = begin; t < end; ++t) {
    const uint8_t* wt = packed + t * tile_bytes;
    const at::Half* dt = dm + t * groups * 32;
    if (bits == 4 && q.rows == 1) tile_one_row_q4(wt, dt, q, 0, groups, out + t * kTile);
    else if (bits == 4) tile_all_rows_q4(q, wt, dt, groups, out + t * kTile, n);
    else tile_all_rows_q8(q, joined, wt, dt, groups, out + t * kTile, n);
  }
#else
  (void)q, (void)joined, (void)packed, (void)dm, (void)n, (void)out, (void)bits, (void)begin, (void)end;
#endif
}
