// Single-query attention over a paged KV cache, row by row (see attend_rows.h).
#include "attend_rows.h"

#include "vec_exp.h"

#include "simd256.h"
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
#elif defined(LOOPSTACK_SIMD256)
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  // the AVX-512 path's 16 lanes
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), hi);
  }
  float sum = reduce_add16(lo, hi);
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
#elif defined(LOOPSTACK_SIMD256)
  const __m256 wv = _mm256_set1_ps(w);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += w * x[i];
}

namespace {

// The group kernels' small loops (over heads and 16-float chunks, bounds known at compile time)
// must unroll and their lambdas inline, or GCC at -O2 keeps the accumulators on the stack: a
// load, FMA and store per chunk and key through memory (the value loop ran 4x slower so)
#define LS_UNROLL _Pragma("GCC unroll 16")
#define LS_INLINE __attribute__((always_inline))

// Sixteen cached K or V entries as floats: the cache holds float32, or float16 (half the bytes a
// long context's attention streams from memory; see attend_rows.h)
#ifdef __AVX512F__
LS_INLINE inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
LS_INLINE inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#elif defined(LOOPSTACK_SIMD256)
LS_INLINE inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
LS_INLINE inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// The largest of n > 0 scores, sixteen lanes at a time (std::max_element is a scalar chain of
// dependent maxss, a tenth of a verification's attention time)
float max_of(const float* x, int64_t n) {
  int64_t p = 0;
  float top = -INFINITY;
#ifdef __AVX512F__
  if (n >= 16) {
    __m512 tops = _mm512_loadu_ps(x);
    for (p = 16; p + 16 <= n; p += 16) tops = _mm512_max_ps(tops, _mm512_loadu_ps(x + p));
    top = _mm512_reduce_max_ps(tops);
  }
#endif
#ifdef LOOPSTACK_SIMD256
  if (n >= 16) {
    __m256 lo = _mm256_loadu_ps(x), hi = _mm256_loadu_ps(x + 8);
    for (p = 16; p + 16 <= n; p += 16) lo = _mm256_max_ps(lo, _mm256_loadu_ps(x + p)), hi = _mm256_max_ps(hi, _mm256_loadu_ps(x + p + 8));
    top = reduce_max16(lo, hi);
  }
#endif
  for (; p < n; ++p) top = std::max(top, x[p]);
  return top;
}

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
#elif defined(LOOPSTACK_SIMD256)
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  // the AVX-512 path's lanes and sum
  for (; p + 16 <= n; p += 16) {
    for (int half = 0; half < 2; ++half) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + p + 8 * half), _mm256_set1_ps(top)));
      _mm256_storeu_ps(x + p + 8 * half, e);
      (half ? hi : lo) = _mm256_add_ps(half ? hi : lo, e);
    }
  }
  total = reduce_add16(lo, hi);
#endif
  for (; p < n; ++p) total += (x[p] = std::exp(x[p] - top));
  return total;
}

// One head at a time for any head_dim, with dot() and axpy() (a float16 cache's entries are
// widened into a row buffer first: a head_dim the group kernels have no shape for is rare).
void score_run_any(const float* query, const float* key, int64_t stride, int64_t count, int64_t dim, float scale,
                   float* out) {
  for (int64_t i = 0; i < count; ++i, key += stride) out[i] = dot(query, key, dim) * scale;
}

void value_run_any(const float* weights, const float* value, int64_t stride, int64_t count, int64_t dim, float* acc) {
  for (int64_t i = 0; i < count; ++i, value += stride) axpy(weights[i], value, acc, dim);
}

void score_run_any(const float* query, const c10::Half* key, int64_t stride, int64_t count, int64_t dim, float scale,
                   float* out) {
  std::vector<float> row(dim);
  for (int64_t i = 0; i < count; ++i, key += stride) {
    for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<float>(key[d]);
    out[i] = dot(query, row.data(), dim) * scale;
  }
}

void value_run_any(const float* weights, const c10::Half* value, int64_t stride, int64_t count, int64_t dim,
                   float* acc) {
  std::vector<float> row(dim);
  for (int64_t i = 0; i < count; ++i, value += stride) {
    for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<float>(value[d]);
    axpy(weights[i], row.data(), acc, dim);
  }
}

#ifdef __AVX512F__
// Lane j of the result is the sum of the sixteen lanes of vector(j), j = 0..15: a transpose and add
// in four levels (pairs within 128-bit lanes, then quads, then across lanes), about three
// instructions a key instead of a horizontal reduction's eight.
template <class Vector>
LS_INLINE inline __m512 sum_lanes16(Vector&& vector) {
  auto pair = [&](int j) LS_INLINE {  // per 128-bit lane: (j, j+1, j, j+1) partial sums
    const __m512 a = vector(j), b = vector(j + 1);
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  };
  auto quad = [&](int j) LS_INLINE {  // per 128-bit lane: keys j..j+3, each summed over that lane
    const __m512d a = _mm512_castps_pd(pair(j)), b = _mm512_castps_pd(pair(j + 2));
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  };
  auto across = [](__m512 a, __m512 b) LS_INLINE {  // (a0 + a1, a2 + a3, b0 + b1, b2 + b3) by 128-bit lane
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return across(across(quad(0), quad(4)), across(quad(8), quad(12)));
}

// The same for all G query heads of a KV group at once: each key (and value) is loaded once for the
// G heads, which keep their queries (and outputs) in registers. out and weights: G rows `ld` apart.
template <int C, int G, class KV>
void score_group(const float* queries, const KV* key, int64_t stride, int64_t count, float scale, float* out,
                 int64_t ld) {
  __m512 q[G][C];
  LS_UNROLL for (int g = 0; g < G; ++g)
    LS_UNROLL for (int c = 0; c < C; ++c) q[g][c] = _mm512_loadu_ps(queries + g * 16 * C + 16 * c);
  auto partial = [&](const KV* k_row, int g) LS_INLINE {  // the 16 lanes whose sum is q_g . k
    __m512 a = _mm512_mul_ps(q[g][0], load16(k_row));
    __m512 b = C > 1 ? _mm512_mul_ps(q[g][1], load16(k_row + 16)) : _mm512_setzero_ps();
    LS_UNROLL for (int c = 2; c < C; c += 2) {
      a = _mm512_fmadd_ps(q[g][c], load16(k_row + 16 * c), a);
      if (c + 1 < C) b = _mm512_fmadd_ps(q[g][c + 1], load16(k_row + 16 * (c + 1)), b);
    }
    return _mm512_add_ps(a, b);
  };
  // sixteen keys a time: their sixteen partial vectors are summed lane-wise into one vector of
  // sixteen scores; a key of a short last batch gets the same tree (the missing keys are zeros), so
  // each score's bits depend on its key and query only
  const __m512 scales = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < count; i += 16, key += 16 * stride) {
    const int64_t n = std::min<int64_t>(16, count - i);
    const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
    LS_UNROLL for (int g = 0; g < G; ++g) {
      const __m512 sums = n == 16 ? sum_lanes16([&](int j) LS_INLINE { return partial(key + j * stride, g); })
                                  : sum_lanes16([&](int j) LS_INLINE { return j < n ? partial(key + j * stride, g) : _mm512_setzero_ps(); });
      _mm512_mask_storeu_ps(out + g * ld + i, keep, _mm512_mul_ps(sums, scales));
    }
  }
}

template <int C, int G, class KV>
void value_group(const float* weights, int64_t ld, const KV* value, int64_t stride, int64_t count, float* acc) {
  __m512 a[G][C];
  LS_UNROLL for (int g = 0; g < G; ++g)
    LS_UNROLL for (int c = 0; c < C; ++c) a[g][c] = _mm512_loadu_ps(acc + g * 16 * C + 16 * c);
  for (int64_t i = 0; i < count; ++i, value += stride) {
    __m512 v[C];
    LS_UNROLL for (int c = 0; c < C; ++c) v[c] = load16(value + 16 * c);
    LS_UNROLL for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(weights[g * ld + i]);
      LS_UNROLL for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(w, v[c], a[g][c]);
    }
  }
  LS_UNROLL for (int g = 0; g < G; ++g)
    LS_UNROLL for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * 16 * C + 16 * c, a[g][c]);
}
#endif

#ifdef LOOPSTACK_SIMD256
// The AVX-512 group kernels above on eight-float halves, with their bits: a key's 16-lane partial
// vector is computed as two halves with the same per-lane steps, and sum16 folds it in
// sum_lanes16's order, lane l of 128-bit quarter L being ((e0 + e2) + (e1 + e3)) and the quarters
// ((L0 + L1) + (L2 + L3)).
// Four keys' sums from their partial vectors' halves lo[j] (lanes 0-7) and hi[j] (8-15).
LS_INLINE inline __m128 sum4_keys(const __m256* lo, const __m256* hi) {
  auto quarters = [](const __m256* v) LS_INLINE {  // [quarter 0 | quarter 1] sums of keys 0..3
    auto pair = [&](int j) LS_INLINE { return _mm256_add_ps(_mm256_unpacklo_ps(v[j], v[j + 1]), _mm256_unpackhi_ps(v[j], v[j + 1])); };
    const __m256d a = _mm256_castps_pd(pair(0)), b = _mm256_castps_pd(pair(2));
    return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  };
  const __m256 low = quarters(lo), high = quarters(hi);
  const __m128 first = _mm_add_ps(_mm256_castps256_ps128(low), _mm256_extractf128_ps(low, 1));
  const __m128 second = _mm_add_ps(_mm256_castps256_ps128(high), _mm256_extractf128_ps(high, 1));
  return _mm_add_ps(first, second);
}

// C chunks of 16 floats a head (as the AVX-512 kernels count them), G heads a call
template <int C, int G, class KV>
void score_group8(const float* queries, const KV* key, int64_t stride, int64_t count, float scale, float* out,
                  int64_t ld) {
  const __m128 scales = _mm_set1_ps(scale);
  for (int64_t i = 0; i < count; i += 16, key += 16 * stride) {
    const int64_t n = std::min<int64_t>(16, count - i);
    LS_UNROLL for (int g = 0; g < G; ++g) {
      const float* query = queries + g * 16 * C;
      alignas(16) float sums[16];
      for (int quad = 0; quad < 4; ++quad) {
        __m256 lo[4], hi[4];
        LS_UNROLL for (int j = 0; j < 4; ++j) {
          const int key_index = 4 * quad + j;
          if (key_index >= n) {  // a short last batch's missing keys are zeros, as there
            lo[j] = hi[j] = _mm256_setzero_ps();
            continue;
          }
          const KV* k_row = key + key_index * stride;
          LS_UNROLL for (int h = 0; h < 2; ++h) {  // the partial vector's half h, as partial() there
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(query + 8 * h), load8(k_row + 8 * h));
            __m256 b = C > 1 ? _mm256_mul_ps(_mm256_loadu_ps(query + 16 + 8 * h), load8(k_row + 16 + 8 * h)) : _mm256_setzero_ps();
            LS_UNROLL for (int c = 2; c < C; c += 2) {
              a = _mm256_fmadd_ps(_mm256_loadu_ps(query + 16 * c + 8 * h), load8(k_row + 16 * c + 8 * h), a);
              if (c + 1 < C) b = _mm256_fmadd_ps(_mm256_loadu_ps(query + 16 * (c + 1) + 8 * h), load8(k_row + 16 * (c + 1) + 8 * h), b);
            }
            (h ? hi : lo)[j] = _mm256_add_ps(a, b);
          }
        }
        _mm_store_ps(sums + 4 * quad, _mm_mul_ps(sum4_keys(lo, hi), scales));
      }
      std::copy(sums, sums + n, out + g * ld + i);
    }
  }
}

template <int C, int G, class KV>
void value_group8(const float* weights, int64_t ld, const KV* value, int64_t stride, int64_t count, float* acc) {
  __m256 a[G][2 * C];
  LS_UNROLL for (int g = 0; g < G; ++g)
    LS_UNROLL for (int c = 0; c < 2 * C; ++c) a[g][c] = _mm256_loadu_ps(acc + g * 16 * C + 8 * c);
  for (int64_t i = 0; i < count; ++i, value += stride) {
    LS_UNROLL for (int g = 0; g < G; ++g) {
      const __m256 w = _mm256_set1_ps(weights[g * ld + i]);
      LS_UNROLL for (int c = 0; c < 2 * C; ++c) a[g][c] = _mm256_fmadd_ps(w, load8(value + 8 * c), a[g][c]);
    }
  }
  LS_UNROLL for (int g = 0; g < G; ++g)
    LS_UNROLL for (int c = 0; c < 2 * C; ++c) _mm256_storeu_ps(acc + g * 16 * C + 8 * c, a[g][c]);
}
#endif

template <class KV>
struct Runs {
  using ScoreGroup = void (*)(const float*, const KV*, int64_t, int64_t, float, float*, int64_t);
  using ValueGroup = void (*)(const float*, int64_t, const KV*, int64_t, int64_t, float*);
  ScoreGroup score = nullptr;  // null: one head at a time with dot() and axpy()
  ValueGroup value = nullptr;
  int64_t heads = 1;  // query heads each call covers
};

#ifdef __AVX512F__
template <int C, class KV>
Runs<KV> group_runs(int64_t group) {
  // as many heads of the group a call as keep their queries and outputs in registers (G x C of 32)
  if constexpr (C <= 4) {
    if (group % 4 == 0) return {score_group<C, 4, KV>, value_group<C, 4, KV>, 4};
    if (group % 3 == 0) return {score_group<C, 3, KV>, value_group<C, 3, KV>, 3};
  }
  if constexpr (C <= 8) {
    if (group % 2 == 0) return {score_group<C, 2, KV>, value_group<C, 2, KV>, 2};
  }
  return {score_group<C, 1, KV>, value_group<C, 1, KV>, 1};
}
#endif

#ifdef LOOPSTACK_SIMD256
template <int C, class KV>
Runs<KV> group_runs8(int64_t group) {
  // sixteen ymm registers: the values' accumulators of G heads are G x 2C of them
  if constexpr (C <= 2) {
    if (group % 3 == 0) return {score_group8<C, 3, KV>, value_group8<C, 3, KV>, 3};
    if (group % 2 == 0) return {score_group8<C, 2, KV>, value_group8<C, 2, KV>, 2};
  }
  return {score_group8<C, 1, KV>, value_group8<C, 1, KV>, 1};
}
#endif

template <class KV>
Runs<KV> runs_for(int64_t dim, int64_t group) {
#ifdef LOOPSTACK_SIMD256
  switch (dim) {
    case 32: return group_runs8<2, KV>(group);
    case 64: return group_runs8<4, KV>(group);
    case 128: return group_runs8<8, KV>(group);
    default: break;
  }
#endif
#ifdef __AVX512F__
  switch (dim) {
    case 32: return group_runs<2, KV>(group);
    case 64: return group_runs<4, KV>(group);
    case 128: return group_runs<8, KV>(group);
    case 256: return group_runs<16, KV>(group);
    default: break;
  }
#endif
  (void)dim, (void)group;
  return {};
}

// A context is cut into spans of this many positions, each attended on its own and merged after
// (as flash-decoding does): long contexts spread over every thread, and the cut depends on the
// context length only, so a row's bits do not depend on the batch or the thread count.
constexpr int64_t kSpan = 256;
constexpr int64_t kMinChunkPositions = 384;

struct SpanItem {
  int64_t row, kv_head, begin, end;
};

}  // namespace

template <class KV>
void attend_rows_raw(const AttendShape& s, const float* q, int64_t q_row_stride, const KV* k, const KV* v,
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
  const Runs<KV> runs = runs_for<KV>(dim, group);
  std::vector<float> tops(items.size() * group), sums(items.size() * group), accs(items.size() * group * dim);
  // Worked in another order than stored: the rows of one sequence (a verification's k + 1 rows)
  // side by side for each (KV head, span), so a span's keys and values come from memory for its
  // first row and from cache for the others. Each item's own operations are unchanged: same bits.
  std::vector<int64_t> order(items.size());
  for (int64_t i = 0; i < static_cast<int64_t>(order.size()); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const SpanItem &x = items[a], &y = items[b];
    const int64_t sx = row_seq[x.row], sy = row_seq[y.row];
    if (sx != sy) return sx < sy;
    if (x.kv_head != y.kv_head) return x.kv_head < y.kv_head;
    return x.begin < y.begin;  // then by row: stable
  });
  // Every row's context in one span (a decode step's usual case up to kSpan positions): each item
  // finishes its heads' outputs itself, with the operations the merge below would apply to a single
  // span (its scale e^0 = 1: the same bits), and the merge's parallel section is skipped.
  const bool single_spans = first_item[s.batch] == s.batch * s.num_kv_heads;
  // a thread's share is at least kMinChunkPositions keys (of one KV head): below that, waking the
  // other thread costs more than it saves (one row of 160 positions: 11.5 us alone, 10.9 split)
  int64_t positions = 0;
  for (const SpanItem& item : items) positions += item.end - item.begin;
  const int64_t grain = std::max<int64_t>(1, kMinChunkPositions * static_cast<int64_t>(items.size()) / std::max<int64_t>(positions, 1));
  parallel_chunks(static_cast<int64_t>(items.size()), grain, [&](int64_t first, int64_t last) {
    std::vector<float> scores;
    for (int64_t position = first; position < last; ++position) {
      const int64_t index = order[position];
      const SpanItem& item = items[index];
      const int64_t length = item.end - item.begin;
      const int64_t* blocks = table + row_seq[item.row] * s.table_width;
      // the span in runs of consecutive slots (one table lookup per block); the query heads of
      // the KV group read each key and value together
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
      const KV* keys = k + item.kv_head * dim;
      const KV* values = v + item.kv_head * dim;
      scores.resize(group * length);
      float* top = tops.data() + index * group;
      float* sum = sums.data() + index * group;
      float* acc = accs.data() + index * group * dim;
      std::fill(acc, acc + group * dim, 0.0f);
      for (int64_t g0 = 0; g0 < group; g0 += runs.heads) {
        float* head_scores = scores.data() + g0 * length;  // runs.heads rows of `length`
        const float* query = queries + g0 * dim;
        for_each_run([&](int64_t p, int64_t slot, int64_t count) {
          if (runs.score != nullptr)
            runs.score(query, keys + slot * slot_stride, slot_stride, count, s.scale, head_scores + p, length);
          else score_run_any(query, keys + slot * slot_stride, slot_stride, count, dim, s.scale, head_scores + p);
        });
        for (int64_t g = g0; g < g0 + runs.heads; ++g) {
          float* row_scores = scores.data() + g * length;
          top[g] = max_of(row_scores, length);
          sum[g] = exp_in_place(row_scores, length, top[g]);
        }
        for_each_run([&](int64_t p, int64_t slot, int64_t count) {
          if (runs.value != nullptr)
            runs.value(head_scores + p, length, values + slot * slot_stride, slot_stride, count, acc + g0 * dim);
          else value_run_any(head_scores + p, values + slot * slot_stride, slot_stride, count, dim, acc + g0 * dim);
        });
      }
      if (single_spans) {
        for (int64_t g = 0; g < group; ++g) {
          float* result = out + item.row * s.num_heads * dim + (item.kv_head * group + g) * dim;
          const float inverse = 1.0f / sum[g];
          for (int64_t d = 0; d < dim; ++d) result[d] = acc[g * dim + d] * inverse;
        }
      }
    }
  });
  if (single_spans) return;
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

template void attend_rows_raw<float>(const AttendShape&, const float*, int64_t, const float*, const float*,
                                     const int64_t*, const std::vector<int64_t>&, const std::vector<int64_t>&, float*);
template void attend_rows_raw<c10::Half>(const AttendShape&, const float*, int64_t, const c10::Half*,
                                         const c10::Half*, const int64_t*, const std::vector<int64_t>&,
                                         const std::vector<int64_t>&, float*);
