// Single-query attention over a paged KV cache, row by row (see attend_rows.h).
#include "attend_rows.h"

#include "vec_exp.h"

#include "spin_pool.h"

#include <algorithm>
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

namespace {

// Softmax weights e^(x - top) of n scores in place; returns their sum.
float exp_in_place(float* x, int64_t n, float top) {
  float total = 0;
  int64_t p = 0;
#ifdef __AVX512F__
  __m512 totals = _mm512_setzero_ps();
  for (; p + 16 <= n; p += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + p), _mm512_set1_ps(top)));
    _mm512_storeu_ps(x + p, e);
    totals = _mm512_add_ps(totals, e);
  }
  total = _mm512_reduce_add_ps(totals);
#endif
  for (; p < n; ++p) total += (x[p] = std::exp(x[p] - top));
  return total;
}

#ifdef __AVX512F__
// One query against `count` keys `stride` floats apart, the query in registers: out[i] = q . k_i * scale.
template <int C>  // head_dim = 16 * C
void score_run(const float* query, const float* key, int64_t stride, int64_t count, float scale, float* out) {
  __m512 q[C];
  for (int c = 0; c < C; ++c) q[c] = _mm512_loadu_ps(query + 16 * c);
  for (int64_t i = 0; i < count; ++i, key += stride) {
    __m512 a = _mm512_mul_ps(q[0], _mm512_loadu_ps(key));
    __m512 b = C > 1 ? _mm512_mul_ps(q[1], _mm512_loadu_ps(key + 16)) : _mm512_setzero_ps();
    for (int c = 2; c < C; c += 2) {
      a = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(key + 16 * c), a);
      if (c + 1 < C) b = _mm512_fmadd_ps(q[c + 1], _mm512_loadu_ps(key + 16 * (c + 1)), b);
    }
    out[i] = _mm512_reduce_add_ps(_mm512_add_ps(a, b)) * scale;
  }
}

// acc += sum_i weights[i] * v_i over `count` values `stride` floats apart, two positions at a time
// into two sets of registers.
template <int C>
void value_run(const float* weights, const float* value, int64_t stride, int64_t count, float* acc) {
  __m512 a[C], b[C];
  for (int c = 0; c < C; ++c) a[c] = _mm512_loadu_ps(acc + 16 * c), b[c] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 2 <= count; i += 2, value += 2 * stride) {
    const __m512 w0 = _mm512_set1_ps(weights[i]), w1 = _mm512_set1_ps(weights[i + 1]);
    for (int c = 0; c < C; ++c) {
      a[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(value + 16 * c), a[c]);
      b[c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(value + stride + 16 * c), b[c]);
    }
  }
  if (i < count) {
    const __m512 w0 = _mm512_set1_ps(weights[i]);
    for (int c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(value + 16 * c), a[c]);
  }
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + 16 * c, _mm512_add_ps(a[c], b[c]));
}
#endif

// The same for any head_dim, with dot() and axpy().
void score_run_any(const float* query, const float* key, int64_t stride, int64_t count, int64_t dim, float scale,
                   float* out) {
  for (int64_t i = 0; i < count; ++i, key += stride) out[i] = dot(query, key, dim) * scale;
}

void value_run_any(const float* weights, const float* value, int64_t stride, int64_t count, int64_t dim, float* acc) {
  for (int64_t i = 0; i < count; ++i, value += stride) axpy(weights[i], value, acc, dim);
}

using ScoreRun = void (*)(const float*, const float*, int64_t, int64_t, float, float*);
using ValueRun = void (*)(const float*, const float*, int64_t, int64_t, float*);

struct Runs {
  ScoreRun score = nullptr;  // null: the *_any versions
  ValueRun value = nullptr;
};

Runs runs_for(int64_t dim) {
#ifdef __AVX512F__
  switch (dim) {
    case 32: return {score_run<2>, value_run<2>};
    case 64: return {score_run<4>, value_run<4>};
    case 128: return {score_run<8>, value_run<8>};
    case 256: return {score_run<16>, value_run<16>};
    default: break;
  }
#endif
  (void)dim;
  return {};
}

// A context is cut into spans of this many positions, each attended on its own and merged after
// (as flash-decoding does): long contexts spread over every thread, and the cut depends on the
// context length only, so a row's bits do not depend on the batch or the thread count.
constexpr int64_t kSpan = 256;

struct SpanItem {
  int64_t row, kv_head, begin, end;
};

}  // namespace

void attend_rows_raw(const AttendShape& s, const float* q, int64_t q_row_stride, const float* k, const float* v,
                     const int64_t* table, const std::vector<int64_t>& row_seq,
                     const std::vector<int64_t>& row_context_lens, float* out) {
  const int64_t group = s.num_heads / s.num_kv_heads, slot_stride = s.num_kv_heads * s.head_dim, dim = s.head_dim;
  std::vector<SpanItem> items;
  std::vector<int64_t> first_item(s.batch + 1);
  for (int64_t row = 0; row < s.batch; ++row) {
    first_item[row] = static_cast<int64_t>(items.size());
    for (int64_t kv_head = 0; kv_head < s.num_kv_heads; ++kv_head)
      for (int64_t begin = 0; begin < row_context_lens[row]; begin += kSpan)
        items.push_back({row, kv_head, begin, std::min(begin + kSpan, row_context_lens[row])});
  }
  first_item[s.batch] = static_cast<int64_t>(items.size());
  // per item and query head of its group: the span's top score, its weights' sum, its weighted values
  const Runs runs = runs_for(dim);
  std::vector<float> tops(items.size() * group), sums(items.size() * group), accs(items.size() * group * dim);
  parallel_chunks(static_cast<int64_t>(items.size()), 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores;
    for (int64_t index = first; index < last; ++index) {
      const SpanItem& item = items[index];
      const int64_t length = item.end - item.begin;
      const int64_t* blocks = table + row_seq[item.row] * s.table_width;
      // the span in runs of consecutive slots (one table lookup per block); a group's query heads
      // read each run in turn while it is in cache
      auto for_each_run = [&](auto&& body) {
        for (int64_t p = item.begin; p < item.end;) {
          const int64_t offset = p % s.block_size;
          const int64_t slot = s.contiguous_start >= 0 ? s.contiguous_start + p : blocks[p / s.block_size] * s.block_size + offset;
          const int64_t count = std::min(item.end - p, s.block_size - offset);
          body(p - item.begin, slot, count);
          p += count;
        }
      };
      const float* queries = q + item.row * q_row_stride + item.kv_head * group * dim;
      const float* keys = k + item.kv_head * dim;
      const float* values = v + item.kv_head * dim;
      scores.resize(group * length);
      float* top = tops.data() + index * group;
      float* sum = sums.data() + index * group;
      float* acc = accs.data() + index * group * dim;
      std::fill(acc, acc + group * dim, 0.0f);
      for (int64_t g = 0; g < group; ++g) {
        float* head_scores = scores.data() + g * length;
        const float* query = queries + g * dim;
        for_each_run([&](int64_t p, int64_t slot, int64_t count) {
          if (runs.score != nullptr) runs.score(query, keys + slot * slot_stride, slot_stride, count, s.scale, head_scores + p);
          else score_run_any(query, keys + slot * slot_stride, slot_stride, count, dim, s.scale, head_scores + p);
        });
        top[g] = *std::max_element(head_scores, head_scores + length);
        sum[g] = exp_in_place(head_scores, length, top[g]);
        for_each_run([&](int64_t p, int64_t slot, int64_t count) {
          if (runs.value != nullptr) runs.value(head_scores + p, values + slot * slot_stride, slot_stride, count, acc + g * dim);
          else value_run_any(head_scores + p, values + slot * slot_stride, slot_stride, count, dim, acc + g * dim);
        });
      }
    }
  });
  // merge each (row, head)'s spans in order
  parallel_chunks(s.batch * s.num_heads, 8, [&](int64_t first, int64_t last) {
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t row = pair / s.num_heads, head = pair % s.num_heads, kv_head = head / group, g = head % group;
      const int64_t spans = (first_item[row + 1] - first_item[row]) / s.num_kv_heads;
      const int64_t base = first_item[row] + kv_head * spans;
      float top = -INFINITY;
      for (int64_t i = base; i < base + spans; ++i) top = std::max(top, tops[i * group + g]);
      float* result = out + row * s.num_heads * dim + head * dim;
      std::fill(result, result + dim, 0.0f);
      float total = 0;
      for (int64_t i = base; i < base + spans; ++i) {
        const float scale = std::exp(tops[i * group + g] - top);
        total += scale * sums[i * group + g];
        axpy(scale, accs.data() + (i * group + g) * dim, result, dim);
      }
      const float inverse = 1.0f / total;
      for (int64_t d = 0; d < dim; ++d) result[d] *= inverse;
    }
  });
}
