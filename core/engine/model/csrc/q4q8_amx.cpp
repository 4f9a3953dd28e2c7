// The q4q8 matmul on AMX tiles: the VNNI kernel's integer sums (q4q8_matmul.cpp) from the matrix
// unit, for inputs of several rows.
//
// At 8 input rows the VNNI kernel is compute-bound: each group of 32 inputs costs 16 vpdpbusd a
// row (two digits), about one a cycle. An AMX tile multiply (tdpbsud: signed bytes times unsigned
// bytes into int32) takes up to 16 rows of 64 bytes times a 16 x 64 block in some 16 cycles, so the
// products are nearly free and what is left is moving data: unpacking a tile's 4-bit codes into
// bytes, and reading each group's int32 sums back out of the tiles (there is no move from a tile
// to a vector register: a store, then loads) to scale them.
//
// The scales are why the sums come out group by group: a weight group has its own d (and m) for
// each weight row and an input group its own s for each input row, so a group's integer sums
// cannot be added to the next group's before they are scaled. Per group g and weight row tile:
//   B (tile 0, or 5 for odd groups): the 16 weight rows' codes of inputs 32g .. 32g + 31 in the
//     layout tiles multiply (8 rows of 64 bytes, row r holding inputs 4r .. 4r + 3 of every
//     weight row, byte 4j + i of weight row j): pack_q8's chunks are already that layout, pack_q4's
//     nibbles are unpacked into it (chunk c's low nibbles are row 2c, its high ones row 2c + 1);
//   A (tiles 1, 2): the input rows' high and low digits of the group, read in place from
//     QuantizedRows (a row's group is 64 bytes: 32 high digits, then 32 low);
//   C (tiles 6, 7, or 3, 4 for odd groups): rows x 16 int32 sums, high and low, stored and
//     combined exactly as the VNNI kernel combines them: (high << 7) + low, then two fused
//     multiply-adds in float, group after group in the same order. So every output has the same
//     bits from either kernel, and a row's result does not depend on the batch it is in or on
//     which kernel served it.
//
// Two stores of sums a group cost about what the VNNI kernel's products cost up to some 8 rows;
// past that the tiles win (q4q8_amx.h's amx_min_rows). A one-sum layout (x = (high * 16 + low) * s,
// the codes times 16 unpacked beside the codes, one multiply and one store a group) was built and
// measured (docs/engine.md): writing twice the unpacked bytes ate what the saved store gave back,
// 0.88x the VNNI kernel at 8 rows on gate/up and 1.19x on down, for a KL of 3e-5 instead of 4e-7;
// not kept.
#include "q4q8_amx.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <vector>
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LOOPSTACK_Q4Q8_AMX 1
#endif

namespace {

using q4q8::kGroup, q4q8::kLowBits, q4q8::kTile;
constexpr int kMaxTileRows = 16;

std::atomic<bool> allowed{true};  // q4q8_use_amx

#ifdef LOOPSTACK_Q4Q8_AMX
// The operating system hands out the tiles' 8 KB of register state only when asked (Linux 5.16+).
constexpr long kArchRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
constexpr long kTileData = 18;                   // XFEATURE_XTILEDATA

struct TileConfig {  // the 64-byte operand of ldtilecfg, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0 and 5, B (32 inputs x 16 weight rows: 8 rows of 64 bytes), for even and odd groups;
// 1 and 2, A (rows x 32 high, then low, digits); 6, 7 (even groups) and 3, 4 (odd), C (rows x 16
// int32 sums, high and low).
void configure(int rows) {
  TileConfig config;
  for (int t : {0, 5}) config.rows[t] = 8, config.colsb[t] = 64;
  for (int t : {1, 2}) config.rows[t] = rows, config.colsb[t] = 32;
  for (int t : {3, 4, 6, 7}) config.rows[t] = rows, config.colsb[t] = 64;
  // ldtilecfg's intrinsic does not tell GCC it reads the struct: without this barrier the stores
  // above are dropped as dead and the load faults on an invalid configuration
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// The outputs of weight row tile `w` for R input rows from r0 (tiles configured for R rows).
// `unpacked` holds the tile's 4-bit codes as bytes, every group (unpack_tile), so the tile loads
// never wait on stores just made; groups alternate between two sets of tile registers, so one
// group's multiplies overlap the last one's read-out.
template <int Bits, int R>
void tile_rows(const uint8_t* w, const uint8_t* unpacked, const at::Half* dm, const QuantizedRows& q, int64_t r0,
               int64_t groups, float* out, int64_t out_stride) {
  alignas(64) int32_t sums_of[2][2][R * kTile];  // [parity][high, low]
  const int64_t row_stride = groups * 2 * kGroup;  // bytes from one input row's group to the next row's
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t distance = r0 == 0 ? q4q8::prefetch_bytes() : 0;  // later blocks: in cache already
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* b = Bits == 4 ? unpacked + g * 8 * 64 : w + g * kTile * kGroup;
    if (Bits == 8 && distance > 0) {  // 4-bit codes are read (and prefetched) by unpack_tile
#pragma GCC unroll 8
      for (int line = 0; line < 8; ++line) _mm_prefetch(reinterpret_cast<const char*>(b + distance + 64 * line), _MM_HINT_T0);
    }
    if (distance > 0)
      _mm_prefetch(reinterpret_cast<const char*>(dm + g * 32) + distance * 64 / (kTile * kGroup * Bits / 8), _MM_HINT_T0);
    const int8_t* digits = q.codes.data() + (r0 * groups + g) * 2 * kGroup;
    int32_t* high = sums_of[g & 1][0];
    int32_t* low = sums_of[g & 1][1];
    // the AMX intrinsics take tile numbers as literals (they are spelled into the instruction)
#define LOOPSTACK_GROUP_SUMS(B, HIGH, LOW)        \
  _tile_loadd(B, b, 64);                          \
  _tile_loadd(1, digits, row_stride);             \
  _tile_loadd(2, digits + kGroup, row_stride);    \
  _tile_zero(HIGH);                               \
  _tile_zero(LOW);                                \
  _tile_dpbsud(HIGH, 1, B);                       \
  _tile_dpbsud(LOW, 2, B);                        \
  _tile_stored(HIGH, high, 64);                   \
  _tile_stored(LOW, low, 64);
    if (g & 1) {
      LOOPSTACK_GROUP_SUMS(5, 3, 4)
    } else {
      LOOPSTACK_GROUP_SUMS(0, 6, 7)
    }
#undef LOOPSTACK_GROUP_SUMS
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32 + 16)));
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m512i sums = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(high + i * kTile), kLowBits),
                                            _mm512_load_si512(low + i * kTile));
      const float* s = q.scales.data() + ((r0 + i) * groups + g) * 2;  // (s, sum(x))
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(d, _mm512_set1_ps(s[0])), acc[i]);
      acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(s[1]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(out + i * out_stride, acc[i]);
}

// A 4-bit tile's codes as the bytes tiles multiply, group after group (8 rows of 64 bytes each).
void unpack_tile(const uint8_t* w, int64_t groups, uint8_t* into) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const int64_t distance = q4q8::prefetch_bytes();
  for (int64_t g = 0; g < groups; ++g) {
    if (distance > 0) {
#pragma GCC unroll 4
      for (int line = 0; line < 4; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(w + g * kTile * kGroup / 2 + distance + 64 * line), _MM_HINT_T0);
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {  // chunk c: its low nibbles are B's row 2c, its high ones row 2c + 1
      const __m512i bytes = _mm512_loadu_si512(w + g * kTile * kGroup / 2 + c * 64);
      _mm512_store_si512(into + g * 512 + 128 * c, _mm512_and_si512(bytes, low_nibbles));
      _mm512_store_si512(into + g * 512 + 128 * c + 64, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles));
    }
  }
}

// One block of `rows` input rows (tiles configured for it) through weight row tile `w`.
template <int Bits>
void block_rows(int rows, const uint8_t* w, const uint8_t* unpacked, const at::Half* dm, const QuantizedRows& q,
                int64_t r0, int64_t groups, float* out, int64_t out_stride) {
  switch (rows) {
#define LOOPSTACK_AMX_ROWS(R) \
  case R: tile_rows<Bits, R>(w, unpacked, dm, q, r0, groups, out, out_stride); break;
    LOOPSTACK_AMX_ROWS(1) LOOPSTACK_AMX_ROWS(2) LOOPSTACK_AMX_ROWS(3) LOOPSTACK_AMX_ROWS(4)
    LOOPSTACK_AMX_ROWS(5) LOOPSTACK_AMX_ROWS(6) LOOPSTACK_AMX_ROWS(7) LOOPSTACK_AMX_ROWS(8)
    LOOPSTACK_AMX_ROWS(9) LOOPSTACK_AMX_ROWS(10) LOOPSTACK_AMX_ROWS(11) LOOPSTACK_AMX_ROWS(12)
    LOOPSTACK_AMX_ROWS(13) LOOPSTACK_AMX_ROWS(14) LOOPSTACK_AMX_ROWS(15) LOOPSTACK_AMX_ROWS(16)
#undef LOOPSTACK_AMX_ROWS
    default: break;
  }
}

// Weight row tiles [begin, end) for every input row: each tile's 4-bit codes are unpacked once and
// serve every block of rows (up to 16 a block, the blocks as even as can be: 24 rows are 12 + 12,
// so one tile configuration serves both; 17 are 9 + 8, configured per block).
template <int Bits>
void all_rows(const QuantizedRows& q, const uint8_t* packed, const at::Half* dm, int64_t n, float* out,
              int64_t begin, int64_t end) {
  const int64_t groups = q.k / kGroup, tile_bytes = groups * kTile * kGroup * Bits / 8;
  const int64_t blocks = (q.rows + kMaxTileRows - 1) / kMaxTileRows;
  thread_local std::vector<uint8_t> buffer;  // the unpacked codes, 64-byte aligned inside it
  if (Bits == 4 && static_cast<int64_t>(buffer.size()) < groups * 512 + 63) buffer.resize(groups * 512 + 63);
  uint8_t* unpacked = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
  int configured = 0;
  for (int64_t t = begin; t < end; ++t) {
    if constexpr (Bits == 4) unpack_tile(packed + t * tile_bytes, groups, unpacked);
    for (int64_t b = 0, r0 = 0; b < blocks; ++b) {
      const int rows = static_cast<int>((q.rows - r0) / (blocks - b));  // the rest, spread evenly
      if (rows != configured) configure(rows), configured = rows;
      block_rows<Bits>(rows, packed + t * tile_bytes, unpacked, dm + t * groups * 32, q, r0, groups,
                       out + r0 * n + t * kTile, n);
      r0 += rows;
    }
  }
}
#endif

}  // namespace

bool q4q8_use_amx(bool enabled) {
  allowed.store(enabled);
  return q4q8_amx_ready();
}

bool q4q8_amx_ready() {
#ifdef LOOPSTACK_Q4Q8_AMX
  // asked once per process: the grant is inherited by a forked child and a spawned one asks anew
  static const bool granted = [] {
    const char* setting = std::getenv("LOOPSTACK_AMX");
    if (setting && std::strcmp(setting, "0") == 0) return false;
    return syscall(SYS_arch_prctl, kArchRequestPermission, kTileData) == 0;
  }();
  return granted && allowed.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

void q4q8_amx_tiles(const QuantizedRows& q, const uint8_t* packed, const at::Half* dm, int64_t n, float* out,
                    int bits, int64_t begin, int64_t end) {
#ifdef LOOPSTACK_Q4Q8_AMX
  if (bits == 4) all_rows<4>(q, packed, dm, n, out, begin, end);
  else all_rows<8>(q, packed, dm, n, out, begin, end);
  _tile_release();
#else
  (void)q, (void)packed, (void)dm, (void)n, (void)out, (void)bits, (void)begin, (void)end;
#endif
}
