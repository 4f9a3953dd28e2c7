// Single-query attention of every (row, head) over exactly its own row's context, from raw
// pointers: shared by the decode loops (decode_layers.cpp, q4q8_decode.cpp).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

struct AttendShape {
  int64_t batch, num_heads, num_kv_heads, head_dim;
  int64_t block_size, table_width;
  int64_t contiguous_start;  // with one sequence whose blocks are consecutive, its first slot, else -1
  float scale;
};

// q: [batch, num_heads, head_dim] floats, q_row_stride apart; k, v: [num_slots, num_kv_heads,
// head_dim] of one layer, KV float (a float32 cache) or c10::Half (a float16 one: half the bytes,
// and a long context's attention is bound by reading them); table: [num_seqs, table_width] block ids; row_seq: each row's sequence;
// out: [batch, num_heads * head_dim]. Work is split by (row, kv head, span of 256 positions), each with its own fixed order
// of operations: a row's output is the same bits whatever else is in the batch.
template <class KV>
void attend_rows_raw(const AttendShape& shape, const float* q, int64_t q_row_stride, const KV* k, const KV* v,
                     const int64_t* table, const std::vector<int64_t>& row_seq,
                     const std::vector<int64_t>& row_context_lens, float* out);

// dot product and y += w * x, AVX-512 where compiled for it
float dot(const float* a, const float* b, int64_t n);
void axpy(float w, const float* x, float* y, int64_t n);
