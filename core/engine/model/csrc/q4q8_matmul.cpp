// 4-bit weights x 8-bit activations, integer dot products (AVX-512 VNNI), for decode-sized inputs.
//
// A decode step reads every weight once per token, so its speed is set by weight bytes and by how
// little work each byte costs. Weights: 4-bit codes in groups of 32 inputs, each group with a
// float16 scale d and offset m (weight = code * d + m: GGUF's Q4_1, 5 bits a weight). Each input
// group of 32 is written as two int8 digits with one scale, x ~ (high * 128 + low) * s (15 bits:
// one int8 digit, llama.cpp's Q8_1, costs SmolLM2 KL 4e-3 to the float model through its outlier
// channels; two cost 25% more instructions), so a group's dot product is
// d * s * (128 * sum(code * high) + sum(code * low)) + m * sum(x), each sum(code * digit) a chain
// of vpdpbusd (unsigned x signed bytes, 64 products an instruction). This is llama.cpp's Q4_1 x
// Q8_1 path on this kind of CPU with a second digit, the weights laid out for it the way
// llama.cpp's repacked formats are:
//
// Layout (quant.py's pack_q4): 16 weight rows side by side. packed [N / 16, K / 32, 256] uint8:
// for row tile t and group g, four chunks of 64 bytes, chunk c covering inputs 32g + 8c .. + 7;
// byte 4j + i of a chunk holds row 16t + j's code of input 32g + 8c + i in its low nibble and of
// input 32g + 8c + 4 + i in its high one. So one vpdpbusd of a chunk's low (or high) nibbles with
// 4 input codes broadcast adds 4 products to each of the 16 rows' lanes: 64 products an
// instruction, no horizontal sums, and a group's scales apply to all 16 rows at once.
// dm [N / 16, K / 32, 32] float16: the tile's 16 d of group g, then its 16 m.
// 8-bit codes (quant.py's pack_q8: GGUF's Q8_0 as code = q + 128, m = -128 d, for the output head)
// take [N / 16, K / 32, 512]: chunk c of 64 bytes holds inputs 32g + 4c .. + 3, byte 4j + i row
// 16t + j's code of input 32g + 4c + i.
//
// The weights stream from memory once a step (a decode step's ~60 MB do not stay in cache between
// steps), tile after tile, and the hardware's prefetcher alone leaves the multiplies waiting on
// them: each group asks for the codes (and scales) kPrefetchBytes ahead (q4q8_matmul.h), about
// a fifth off a batch-1 and a batch-8 decode step here. Only a tile's first pass over its rows
// asks; later passes find the codes in cache.
#include "q4q8_matmul.h"

#include "q4q8_amx.h"
#include "q4q8_avx2.h"
#include "simd256.h"
#include "spin_pool.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define LOOPSTACK_Q4Q8_VNNI 1
#endif

namespace {

using q4q8::kGroup, q4q8::kLowBits, q4q8::kTile;
constexpr int64_t kTileGroupBytes = kTile * kGroup / 2;  // 256

#ifdef LOOPSTACK_Q4Q8_VNNI
// The 16 outputs of row tile `w` for R consecutive input rows from r0: out[i * out_stride + j].
template <int Bits, int R>
void tile_rows(const uint8_t* w, const at::Half* dm, const QuantizedRows& q, int64_t r0, int64_t groups,
               float* out, int64_t out_stride) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  // every loop over the rows unrolled, this one and the store's too: else GCC keeps acc[] on the
  // stack, a store and a load of each row's sums a group (8-row tiles: 1.25x as long, in cache)
  __m512 acc[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t distance = r0 == 0 ? q4q8::prefetch_bytes() : 0;  // later passes: in cache already
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * kTile * kGroup * Bits / 8;
    if (distance > 0) {
#pragma GCC unroll 8
      for (int line = 0; line < kTile * kGroup * Bits / 8 / 64; ++line) _mm_prefetch(reinterpret_cast<const char*>(wg + distance + 64 * line), _MM_HINT_T0);
      // the same groups ahead in the scales (64 bytes a group)
      _mm_prefetch(reinterpret_cast<const char*>(dm + g * 32) + distance * 64 / (kTile * kGroup * Bits / 8), _MM_HINT_T0);
    }
    __m512i codes[8];  // codes[j]: the 16 rows' codes of inputs 4j .. 4j + 3 of the group
    if constexpr (Bits == 4) {
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {  // chunk c: inputs 8c .. 8c + 3 low nibbles, 8c + 4 .. 8c + 7 high
        const __m512i bytes = _mm512_loadu_si512(wg + c * 64);
        codes[2 * c] = _mm512_and_si512(bytes, low_nibbles);
        codes[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
      }
    } else {
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) codes[c] = _mm512_loadu_si512(wg + c * 64);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32 + 16)));
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const int64_t row = r0 + i;
      // the group's 32 high digits, then its 32 low ones
      const int32_t* x = reinterpret_cast<const int32_t*>(q.codes.data() + (row * groups + g) * 2 * kGroup);
      __m512i high = _mm512_setzero_si512(), low = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        high = _mm512_dpbusd_epi32(high, codes[j], _mm512_set1_epi32(x[j]));
        low = _mm512_dpbusd_epi32(low, codes[j], _mm512_set1_epi32(x[8 + j]));
      }
      const __m512i sums = _mm512_add_epi32(_mm512_slli_epi32(high, kLowBits), low);  // sum(code * x / s)
      const float* s = q.scales.data() + (row * groups + g) * 2;  // (s, sum(x))
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(d, _mm512_set1_ps(s[0])), acc[i]);
      acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(s[1]), acc[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(out + i * out_stride, acc[i]);
}
#else
int32_t code_of(const uint8_t* w, int bits, int64_t g, int64_t j, int64_t k) {  // row j, input k of group g
  if (bits == 8) return w[g * 512 + (k / 4) * 64 + 4 * j + k % 4];
  const uint8_t byte = w[g * kTileGroupBytes + (k / 8) * 64 + 4 * j + k % 4];
  return k % 8 < 4 ? byte & 0x0F : byte >> 4;
}

void tile_rows_scalar(const uint8_t* w, int bits, const at::Half* dm, const QuantizedRows& q, int64_t row,
                      int64_t groups, float* out) {
  for (int64_t j = 0; j < kTile; ++j) {
    float total = 0;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t high = 0, low = 0;
      const int8_t* x = q.codes.data() + (row * groups + g) * 2 * kGroup;
      for (int64_t k = 0; k < kGroup; ++k) {
        const int32_t code = code_of(w, bits, g, j, k);
        high += code * x[k];
        low += code * x[kGroup + k];
      }
      const float* s = q.scales.data() + (row * groups + g) * 2;
      total += static_cast<float>(dm[g * 32 + j]) * s[0] * static_cast<float>(high * (1 << kLowBits) + low) +
               static_cast<float>(dm[g * 32 + 16 + j]) * s[1];
    }
    out[j] = total;
  }
}
#endif

}  // namespace

namespace {
int64_t initial_prefetch() {
  const char* setting = std::getenv("LOOPSTACK_PREFETCH");
  return setting ? std::max<int64_t>(0, std::atoll(setting)) : q4q8::kPrefetchBytes;
}
std::atomic<int64_t> prefetch_distance{initial_prefetch()};
}  // namespace

int64_t q4q8::prefetch_bytes() { return prefetch_distance.load(std::memory_order_relaxed); }

int64_t q4q8_prefetch(int64_t bytes) {
  return prefetch_distance.exchange(bytes < 0 ? prefetch_distance.load() : bytes);
}

bool q4q8_is_vectorized() {
#ifdef LOOPSTACK_Q4Q8_VNNI
  return true;
#else
  return q4q8_avx2_built();
#endif
}

std::string q4q8_instruction_set() {
#ifdef LOOPSTACK_Q4Q8_VNNI
  return q4q8_amx_ready() ? "avx512_vnni+amx" : "avx512_vnni";
#else
  return q4q8_avx2_built() ? "avx2" : "scalar";
#endif
}

void quantize_rows(const float* x, int64_t m, int64_t k, QuantizedRows& q) {
  const int64_t groups = k / kGroup;
  q.rows = m, q.k = k;
  q.codes.resize(m * k * 2);
  q.scales.resize(m * groups * 2);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* in = x + r * k + g * kGroup;
      int8_t* high = q.codes.data() + (r * groups + g) * 2 * kGroup;
      int8_t* low = high + kGroup;
      // x = (high * 128 + low) * scale: high in [-127, 127], low the rounding rest in [-64, 64]
#ifdef LOOPSTACK_Q4Q8_VNNI
      const __m512 a = _mm512_loadu_ps(in), b = _mm512_loadu_ps(in + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const float sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
#elif defined(LOOPSTACK_SIMD256)
      // the VNNI path's a + b as its two halves, and its reductions' order (simd256.h)
      const __m256 sign = _mm256_set1_ps(-0.0f);
      const __m256 a0 = _mm256_loadu_ps(in), a1 = _mm256_loadu_ps(in + 8);
      const __m256 b0 = _mm256_loadu_ps(in + 16), b1 = _mm256_loadu_ps(in + 24);
      const float amax = reduce_max16(_mm256_max_ps(_mm256_andnot_ps(sign, a0), _mm256_andnot_ps(sign, b0)),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, a1), _mm256_andnot_ps(sign, b1)));
      const float sum = reduce_add16(_mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1));
#else
      float amax = 0, sum = 0;
      for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(in[i])), sum += in[i];
#endif
      const float step = amax / 127.0f, scale = step / (1 << kLowBits);
      const float inverse = amax > 0 ? 1.0f / step : 0.0f, low_inverse = amax > 0 ? 1.0f / scale : 0.0f;
#ifdef LOOPSTACK_Q4Q8_VNNI
      constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      for (int half = 0; half < 2; ++half) {
        const __m512 v = half ? b : a;
        const __m512 h = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(inverse)), kNearest);
        const __m512 rest = _mm512_fnmadd_ps(h, _mm512_set1_ps(step), v);
        const __m512 l = _mm512_roundscale_ps(_mm512_mul_ps(rest, _mm512_set1_ps(low_inverse)), kNearest);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(high + 16 * half), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(h)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(low + 16 * half), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(l)));
      }
#elif defined(LOOPSTACK_SIMD256)
      constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      for (int part = 0; part < 4; ++part) {
        const __m256 v = _mm256_loadu_ps(in + 8 * part);
        const __m256 h = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(inverse)), kNearest);
        const __m256 rest = _mm256_fnmadd_ps(h, _mm256_set1_ps(step), v);
        const __m256 l = _mm256_round_ps(_mm256_mul_ps(rest, _mm256_set1_ps(low_inverse)), kNearest);
        alignas(32) int32_t hs[8], ls[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(hs), _mm256_cvtps_epi32(h));
        _mm256_store_si256(reinterpret_cast<__m256i*>(ls), _mm256_cvtps_epi32(l));
        for (int i = 0; i < 8; ++i) high[8 * part + i] = static_cast<int8_t>(hs[i]), low[8 * part + i] = static_cast<int8_t>(ls[i]);
      }
#else
      for (int64_t i = 0; i < kGroup; ++i) {
        const float h = std::nearbyint(in[i] * inverse);
        high[i] = static_cast<int8_t>(h);
        low[i] = static_cast<int8_t>(std::nearbyint((in[i] - h * step) * low_inverse));
      }
#endif
      q.scales[(r * groups + g) * 2] = scale;
      q.scales[(r * groups + g) * 2 + 1] = sum;
    }
  }
}

#ifdef LOOPSTACK_Q4Q8_VNNI
template <int Bits>
void tiles_of(const QuantizedRows& q, const uint8_t* wt, const at::Half* dt, int64_t groups, float* ot, int64_t n) {
  const int64_t m = q.rows;
  int64_t r = 0;
  // eight rows a pass where there are: the tile's codes are unpacked once for all of them
  for (; r + 8 <= m; r += 8) tile_rows<Bits, 8>(wt, dt, q, r, groups, ot + r * n, n);
  for (; r + 4 <= m; r += 4) tile_rows<Bits, 4>(wt, dt, q, r, groups, ot + r * n, n);
  switch (m - r) {
    case 3: tile_rows<Bits, 3>(wt, dt, q, r, groups, ot + r * n, n); break;
    case 2: tile_rows<Bits, 2>(wt, dt, q, r, groups, ot + r * n, n); break;
    case 1: tile_rows<Bits, 1>(wt, dt, q, r, groups, ot + r * n, n); break;
    default: break;
  }
}
#endif

void q4q8_gemm(const QuantizedRows& q, const uint8_t* w, const at::Half* scales, int64_t n, float* out, int bits) {
  const int64_t k = q.k, groups = k / kGroup, tiles = n / kTile;
  TORCH_CHECK(n % kTile == 0 && k % kGroup == 0, "q4q8: N must be a multiple of 16 and K of 32");
  TORCH_CHECK(bits == 4 || bits == 8, "q4q8: 4- or 8-bit codes");
  const int64_t tile_bytes = groups * kTile * kGroup * bits / 8;
  if (q.rows >= amx_min_rows(bits) && q4q8_amx_ready()) {  // the same bits from the matrix unit (q4q8_amx.cpp)
    parallel_chunks(tiles, 4, [&](int64_t begin, int64_t end) {
      q4q8_amx_tiles(q, w, scales, n, out, bits, begin, end);
    });
    return;
  }
  if (q4q8_avx2_built()) {
    const std::vector<int16_t> joined = bits == 8 ? q4q8_joined_digits(q) : std::vector<int16_t>();
    parallel_chunks(tiles, 4, [&](int64_t begin, int64_t end) {
      q4q8_avx2_tiles(q, joined.data(), w, scales, n, out, bits, begin, end);
    });
    return;
  }
  parallel_chunks(tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* wt = w + t * tile_bytes;
      const at::Half* dt = scales + t * groups * 32;
      float* ot = out + t * kTile;
#ifdef LOOPSTACK_Q4Q8_VNNI
      if (bits == 4) tiles_of<4>(q, wt, dt, groups, ot, n);
      else tiles_of<8>(q, wt, dt, groups, ot, n);
#else
      for (int64_t r = 0; r < q.rows; ++r) tile_rows_scalar(wt, bits, dt, q, r, groups, ot + r * n);
#endif
    }
  });
}

at::Tensor q4q8_matmul(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& dm) {
  TORCH_CHECK(rows.dim() == 2 && packed.dim() == 3 && dm.dim() == 3,
              "rows [M, K], packed [N/16, K/32, 256 or 512], dm [N/16, K/32, 32]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && dm.scalar_type() == at::kHalf, "uint8 codes, float16 scales");
  const int64_t m = rows.size(0), k = rows.size(1), n = packed.size(0) * kTile;
  const int bits = packed.size(2) == 2 * kTileGroupBytes ? 8 : 4;
  TORCH_CHECK(k % kGroup == 0 && packed.size(1) == k / kGroup && packed.size(2) == kTileGroupBytes * bits / 4 &&
                  dm.size(0) == packed.size(0) && dm.size(1) == k / kGroup && dm.size(2) == 2 * kTile,
              "shapes do not match: rows ", rows.sizes(), ", packed ", packed.sizes(), ", dm ", dm.sizes());
  TORCH_CHECK(packed.is_contiguous() && dm.is_contiguous(), "packed weights must be contiguous");
  const at::Tensor rows32 = rows.to(at::kFloat).contiguous();
  QuantizedRows q;
  quantize_rows(rows32.data_ptr<float>(), m, k, q);
  at::Tensor out = at::empty({m, n}, rows32.options());
  q4q8_gemm(q, packed.data_ptr<uint8_t>(), dm.data_ptr<at::Half>(), n, out.data_ptr<float>(), bits);
  return rows.scalar_type() == at::kFloat ? out : out.to(rows.scalar_type());
}
