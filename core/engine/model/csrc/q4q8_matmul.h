// 4-bit weights times activations quantized to 8 bits on the fly: the integer dot product a
// decode step on a CPU with AVX-512 VNNI reads the fewest bytes with (see q4q8_matmul.cpp).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <vector>

namespace q4q8 {
constexpr int64_t kGroup = 32;  // inputs a weight group (and an activation group) covers
constexpr int64_t kTile = 16;   // weight rows laid side by side
constexpr int kLowBits = 7;     // an input is two int8 digits, high * 2^7 + low
// How far ahead of the weights being multiplied the kernels ask the cache for the codes (and for
// the same groups' scales), in bytes of codes: the hardware's own prefetcher leaves the
// multiplies waiting on memory (q4q8_matmul.cpp). LOOPSTACK_PREFETCH=N sets it at start, 0: none.
// scripts/ab_knob.py --knob q4q8_prefetch (decode steps in one process, alternating, 6 rounds): against none, 2048
// bytes 0.82-0.86x the batch-1 step and 0.79-0.83x the batch-8 one, 4096 0.78-0.84x and 0.80-0.82x,
// 8192 0.79x and 0.82x (batch 1 likes it far, batch 8 near)
constexpr int64_t kPrefetchBytes = 4096;
int64_t prefetch_bytes();
}  // namespace q4q8

// Input rows quantized per group of 32 to two int8 digits: codes [M, K / 32, 2, 32] (a group's
// high digits, then its low ones) and, per group of each row, (s, sum(x)) with
// x ~ (high * 128 + low) * s.
struct QuantizedRows {
  std::vector<int8_t> codes;
  std::vector<float> scales;
  int64_t rows = 0, k = 0;
};

// Quantize x [m, k] (row-major floats, k a multiple of 32) into q (its buffers reused).
void quantize_rows(const float* x, int64_t m, int64_t k, QuantizedRows& q);

// out [q.rows, n] (row-major) = q's rows times n weight rows of 4- or 8-bit codes (packed, dm as
// below); parallel over tiles of 16 weight rows.
void q4q8_gemm(const QuantizedRows& q, const uint8_t* packed, const at::Half* dm, int64_t n, float* out,
               int bits = 4);

// rows: [M, K] float32 or bfloat16. packed: uint8 [N / 16, K / 32, 256] (4-bit codes) or
// [N / 16, K / 32, 512] (8-bit), dm: float16 [N / 16, K / 32, 32], from quant.py's pack_q4 or
// pack_q8 (weights code * d + m, groups of 32 inputs).
// Returns [M, N] in the rows' dtype; each output row depends on its input row alone (the same
// bits in any batch).
at::Tensor q4q8_matmul(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& dm);

// Set the prefetch distance (bytes of codes ahead; 0: none; negative: leave it); returns the one before.
int64_t q4q8_prefetch(int64_t bytes);

// Whether q4q8_matmul runs a vector kernel: AVX-512 VNNI (q4q8_matmul.cpp) or, without AVX-512,
// AVX2 (q4q8_avx2.cpp), both giving the same bits; else a scalar loop, correct but slow.
bool q4q8_is_vectorized();

// Which kernel q4q8_matmul runs: "avx512_vnni+amx", "avx512_vnni", "avx2" or "scalar".
std::string q4q8_instruction_set();
