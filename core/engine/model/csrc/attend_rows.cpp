// Single-query attention over a paged KV cache, row by row (see attend_rows.h).
#include "attend_rows.h"

#include "vec_exp.h"

#include "spin_pool.h"

#include <cmath>

float dot(const float* a, const float* b, int64_t n) {
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  float sum = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
#else
  float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) partial[j] += a[i + j] * b[i + j];
  float sum = ((partial[0] + partial[1]) + (partial[2] + partial[3])) + ((partial[4] + partial[5]) + (partial[6] + partial[7]));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
#endif
}

void axpy(float w, const float* x, float* y, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 wv = _mm512_set1_ps(w);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += w * x[i];
}

void attend_rows_raw(const AttendShape& s, const float* q, int64_t q_row_stride, const float* k, const float* v,
                     const int64_t* table, const std::vector<int64_t>& row_seq,
                     const std::vector<int64_t>& row_context_lens, float* out) {
  const int64_t group = s.num_heads / s.num_kv_heads, slot_stride = s.num_kv_heads * s.head_dim;
  parallel_chunks(s.batch * s.num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / s.num_heads, head = item % s.num_heads, kv_head = head / group;
      const int64_t length = row_context_lens[row];
      const int64_t* blocks = table + row_seq[row] * s.table_width;
      auto slot_of = [&](int64_t p) {
        return s.contiguous_start >= 0 ? s.contiguous_start + p : blocks[p / s.block_size] * s.block_size + p % s.block_size;
      };
      const float* query = q + row * q_row_stride + head * s.head_dim;
      scores.resize(length);
      float top = -INFINITY;
      for (int64_t p = 0; p < length; ++p) {
        scores[p] = dot(query, k + slot_of(p) * slot_stride + kv_head * s.head_dim, s.head_dim) * s.scale;
        top = scores[p] > top ? scores[p] : top;
      }
      float total = 0;
      int64_t p = 0;
#ifdef __AVX512F__
      __m512 totals = _mm512_setzero_ps();
      for (; p + 16 <= length; p += 16) {
        const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(scores.data() + p), _mm512_set1_ps(top)));
        _mm512_storeu_ps(scores.data() + p, e);
        totals = _mm512_add_ps(totals, e);
      }
      total = _mm512_reduce_add_ps(totals);
#endif
      for (; p < length; ++p) total += (scores[p] = std::exp(scores[p] - top));
      float* result = out + row * s.num_heads * s.head_dim + head * s.head_dim;
      for (int64_t d = 0; d < s.head_dim; ++d) result[d] = 0;
      for (int64_t p = 0; p < length; ++p) axpy(scores[p], v + slot_of(p) * slot_stride + kv_head * s.head_dim, result, s.head_dim);
      const float inverse = 1.0f / total;
      for (int64_t d = 0; d < s.head_dim; ++d) result[d] *= inverse;
    }
  });
}
