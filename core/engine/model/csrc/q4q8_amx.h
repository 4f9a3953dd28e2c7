// The q4q8 matmul on AMX tiles (Intel's matrix unit, Sapphire Rapids and later): the same integer
// sums as the VNNI kernel, from a unit that does sixteen times the products a cycle, for inputs of
// several rows (a batch's decode rows, a draft's verification rows). See q4q8_amx.cpp.
#pragma once

#include "q4q8_matmul.h"

// Whether the AMX kernel is built in and this process may use the tiles (the kernel granted the
// tile state; LOOPSTACK_AMX=0 turns it off) and q4q8_use_amx allows it. The kernel is asked
// once per process.
bool q4q8_amx_ready();

// Allow the AMX kernel (the default where it is ready) or not (every input then takes the VNNI
// kernel: the A/B and the tests that hold the two kernels to the same bits). Returns whether it is
// in use now.
bool q4q8_use_amx(bool enabled);

// The fewest input rows the AMX kernel takes, by code width. Its sums come out of the tiles through
// memory, two stores a group, which costs about what the VNNI kernel's products cost up to some 8
// rows (scripts/bench_q4q8_matmul.py, both kernels side by side, AMX / VNNI time: 4-bit codes
// 0.77-0.97x at 12 rows, 0.74-0.91x at 16; the head's 8-bit codes need no unpacking, 0.82-0.86x at
// 8 rows, 0.69-0.74x at 16; docs/engine.md).
constexpr int64_t amx_min_rows(int bits) { return bits == 8 ? 8 : 12; }

// out[r * n + 16 t + j] for weight row tiles t in [begin, end): the same bits as the VNNI kernel's
// tile_rows, every row of q. Call on the thread that does the work: it configures that thread's
// tiles and releases them before it returns.
void q4q8_amx_tiles(const QuantizedRows& q, const uint8_t* packed, const at::Half* dm, int64_t n, float* out,
                    int bits, int64_t begin, int64_t end);
