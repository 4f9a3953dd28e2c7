// The decoder-layer loop of a decode step for q4q8 projections (quant.py, Int4Linear "q4q8"):
// one new token per sequence, or a few (a speculative verification).
//
// The math of DecoderLayer.forward in llama.py with float32 activations, written as plain loops
// over preallocated buffers: RMSNorm straight into the 8-bit codes the projection reads, rotary
// on the q and k heads, the K/V write, attention (attend_rows.cpp), SwiGLU. A step of a few rows
// splits each matmul and attention across threads (spin_pool.cpp), the rest being a few thousand
// floats per row; a step of several sequences and kRowSplitRows rows or more runs instead as one
// group of whole sequences per thread, each group every layer on its own (no section, no wait
// between the ~150 parts of a step; each row's operations the same either way). No ATen op runs
// between the layers: at ~4 us each, the ~20 per layer of decode_layers.cpp were a quarter of a
// SmolLM2-135M step on 2 cores. See native_decode.py for when it is used.
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "attend_rows.h"
#include "q4q8_matmul.h"
#include "simd256.h"
#include "spin_pool.h"
#include "vec_exp.h"

namespace {

struct Projection {
  const uint8_t* packed;
  const at::Half* dm;
  const float* bias;  // or nullptr
  int64_t out_features;
};

Projection projection(const at::Tensor& packed, const at::Tensor& dm, const at::Tensor* bias = nullptr) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && dm.scalar_type() == at::kHalf && packed.dim() == 3 &&
                  packed.size(2) == 256 && packed.is_contiguous() && dm.is_contiguous(),
              "4-bit q4q8 weights expected (uint8 codes [N/16, K/32, 256], float16 scales)");
  const bool has_bias = bias != nullptr && bias->defined() && bias->numel() > 0;
  TORCH_CHECK(!has_bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous()), "float32 bias expected");
  return {packed.data_ptr<uint8_t>(), dm.data_ptr<at::Half>(), has_bias ? bias->data_ptr<float>() : nullptr,
          packed.size(0) * 16};  // tiles of 16 rows
}

// out [B, N] = q times the projection (+ bias)
void project(const QuantizedRows& q, const Projection& p, float* out) {
  q4q8_gemm(q, p.packed, p.dm, p.out_features, out);
  if (p.bias != nullptr)
    for (int64_t r = 0; r < q.rows; ++r)
      for (int64_t j = 0; j < p.out_features; ++j) out[r * p.out_features + j] += p.bias[j];
}

// h = x * (w * sqrt(H)) / hypot(|x|, sqrt(H * eps)) for each row, as RMSNorm.forward
void rms_norm(const float* x, int64_t batch, int64_t size, const float* scaled_weight, float eps_term, float* h) {
  for (int64_t r = 0; r < batch; ++r) {
    const float* row = x + r * size;
    const float denominator = std::hypot(std::sqrt(dot(row, row, size)), eps_term);
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 denominators = _mm512_set1_ps(denominator);
    for (; i + 16 <= size; i += 16) {
      const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(row + i), _mm512_loadu_ps(scaled_weight + i));
      _mm512_storeu_ps(h + r * size + i, _mm512_div_ps(scaled, denominators));
    }
#elif defined(LOOPSTACK_SIMD256)
    const __m256 denominators = _mm256_set1_ps(denominator);
    for (; i + 8 <= size; i += 8) {
      const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(row + i), _mm256_loadu_ps(scaled_weight + i));
      _mm256_storeu_ps(h + r * size + i, _mm256_div_ps(scaled, denominators));
    }
#endif
    for (; i < size; ++i) h[r * size + i] = row[i] * scaled_weight[i] / denominator;
  }
}

// out[i] = x[i] rounded to float16 (to nearest, ties to even: as c10::Half(x[i]) and torch's .to()),
// sixteen at a time (the scalar conversion was most of a batch-8 step's K/V write)
void to_half(const float* x, int64_t n, c10::Half* out) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(LOOPSTACK_SIMD256)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) out[i] = c10::Half(x[i]);
}

// out[i] = silu(gate[i]) * up[i]
void swiglu(const float* gate, const float* up, int64_t n, float* out) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
  }
#elif defined(LOOPSTACK_SIMD256)
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// Where a decode step's layer loop goes, when asked (q4q8_decode_profile): nanoseconds summed per
// part over the calls since the last reset. Off by default; on, each part costs two clock reads.
enum Part { kNorms, kQkv, kRotary, kAttention, kO, kGateUp, kSwiglu, kDown, kParts };
bool profiling = false;
std::array<int64_t, kParts> part_ns{};
int64_t profiled_calls = 0;

struct PartClock {
  std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
  bool enabled = true;
  void lap(Part part) {
    if (!profiling || !enabled) return;
    const auto now = std::chrono::steady_clock::now();
    part_ns[part] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - last).count();
    last = now;
  }
};

}  // namespace

std::vector<double> q4q8_decode_profile(bool enable, bool reset) {
  std::vector<double> seconds(part_ns.begin(), part_ns.end());
  for (double& s : seconds) s *= 1e-9;
  seconds.push_back(static_cast<double>(profiled_calls));
  if (reset) part_ns.fill(0), profiled_calls = 0;
  profiling = enable;
  return seconds;
}

namespace {

// A decode step of at least this many rows over several sequences runs as one group of sequences
// per thread (row_groups); LOOPSTACK_ROW_SPLIT=N sets it at start, 0: never (q4q8_row_split)
constexpr int64_t kRowSplitRows = 4;

// What the layer loop reads, for every row of the step (see decode_layers_q4q8).
struct LoopInputs {
  float* x;  // [batch, size] the residual stream, updated in place
  const float* cos;
  const float* sin;  // [batch, qkv_heads, head_dim]
  float* cache;  // float32 cache, or nullptr
  c10::Half* half_cache;  // float16 cache, or nullptr
  const int64_t* slot;  // [batch] each row's new K/V slot
  const int64_t* tables;
  const std::vector<at::Tensor>* layer_weights;
  const std::vector<int64_t>* row_seq;
  const std::vector<int64_t>* row_context_lens;
  AttendShape shape;  // batch: every row of the step
  int64_t num_layers, size, num_slots;
};

constexpr int64_t kPerLayer = 13;

// Every layer for rows [begin, end) of the step. Each row's operations are the same whichever rows
// are run together (the matmuls and attention give a row the same bits in any batch), so the step
// may be run as one call over every row or as several over groups of whole sequences.
void run_rows(const LoopInputs& in, int64_t begin, int64_t end, bool timed) {
  const AttendShape& all = in.shape;
  const int64_t batch = end - begin, size = in.size, head_dim = all.head_dim;
  const int64_t num_heads = all.num_heads, num_kv_heads = all.num_kv_heads, half = head_dim / 2;
  const int64_t qkv_heads = num_heads + 2 * num_kv_heads, qkv_size = qkv_heads * head_dim;
  const int64_t kv_size = num_kv_heads * head_dim, num_slots = in.num_slots;
  AttendShape shape = all;
  shape.batch = batch;
  const std::vector<int64_t> row_seq(in.row_seq->begin() + begin, in.row_seq->begin() + end);
  const std::vector<int64_t> context_lens(in.row_context_lens->begin() + begin, in.row_context_lens->begin() + end);
  float* x = in.x + begin * size;
  const float* cos_data = in.cos + begin * qkv_size;
  const float* sin_data = in.sin + begin * qkv_size;
  const int64_t* slot = in.slot + begin;
  std::vector<float> h(batch * size), qkv(batch * qkv_size), attn(batch * num_heads * head_dim), rotated(head_dim);
  std::vector<float> out, gate_up, act;
  QuantizedRows q;
  PartClock clock;
  clock.enabled = timed;
  for (int64_t layer = 0; layer < in.num_layers; ++layer) {
    const at::Tensor* w = in.layer_weights->data() + layer * kPerLayer;
    const Projection qkv_w = projection(w[2], w[3], &w[4]), o_w = projection(w[5], w[6]);
    const Projection gate_up_w = projection(w[9], w[10]), down_w = projection(w[11], w[12]);
    TORCH_CHECK(qkv_w.out_features == qkv_size && o_w.out_features == size && down_w.out_features == size,
                "projection shapes do not match the model");
    const int64_t intermediate = gate_up_w.out_features / 2;
    // attention
    rms_norm(x, batch, size, w[0].data_ptr<float>(), *w[1].data_ptr<float>(), h.data());
    quantize_rows(h.data(), batch, size, q);
    clock.lap(kNorms);
    project(q, qkv_w, qkv.data());
    clock.lap(kQkv);
    const int64_t layer_offset = layer * 2 * num_slots * kv_size;
    for (int64_t r = 0; r < batch; ++r) {
      float* row = qkv.data() + r * qkv_size;
      for (int64_t head = 0; head < num_heads + num_kv_heads; ++head) {  // v's rows of cos/sin are 1/0
        float* v = row + head * head_dim;
        const float* c = cos_data + (r * qkv_heads + head) * head_dim;
        const float* s = sin_data + (r * qkv_heads + head) * head_dim;
        // rotate_half: the first half pairs with the second and the second with the first
        for (int64_t d = 0; d < half; ++d) rotated[d] = v[d] * c[d] + v[d + half] * s[d];
        for (int64_t d = half; d < head_dim; ++d) rotated[d] = v[d] * c[d] + v[d - half] * s[d];
        std::copy(rotated.begin(), rotated.end(), v);
      }
      // this row's K and V into the cache (rounded to float16 as torch's .to() rounds, for a half one)
      const float* k_row = row + num_heads * head_dim;
      const float* v_row = row + (num_heads + num_kv_heads) * head_dim;
      const int64_t k_at = layer_offset + slot[r] * kv_size, v_at = k_at + num_slots * kv_size;
      if (in.half_cache != nullptr) {
        to_half(k_row, kv_size, in.half_cache + k_at);
        to_half(v_row, kv_size, in.half_cache + v_at);
      } else {
        std::copy(k_row, k_row + kv_size, in.cache + k_at);
        std::copy(v_row, v_row + kv_size, in.cache + v_at);
      }
    }
    clock.lap(kRotary);
    if (in.half_cache != nullptr)
      attend_rows_raw(shape, qkv.data(), qkv_size, in.half_cache + layer_offset,
                      in.half_cache + layer_offset + num_slots * kv_size, in.tables, row_seq, context_lens,
                      attn.data());
    else
      attend_rows_raw(shape, qkv.data(), qkv_size, in.cache + layer_offset,
                      in.cache + layer_offset + num_slots * kv_size, in.tables, row_seq, context_lens, attn.data());
    clock.lap(kAttention);
    quantize_rows(attn.data(), batch, num_heads * head_dim, q);
    out.resize(batch * size);
    clock.lap(kNorms);
    project(q, o_w, out.data());
    clock.lap(kO);
    for (int64_t i = 0; i < batch * size; ++i) x[i] += out[i];
    // MLP (SwiGLU)
    rms_norm(x, batch, size, w[7].data_ptr<float>(), *w[8].data_ptr<float>(), h.data());
    quantize_rows(h.data(), batch, size, q);
    gate_up.resize(batch * 2 * intermediate);
    clock.lap(kNorms);
    project(q, gate_up_w, gate_up.data());
    clock.lap(kGateUp);
    act.resize(batch * intermediate);
    for (int64_t r = 0; r < batch; ++r) {
      const float* row = gate_up.data() + r * 2 * intermediate;
      swiglu(row, row + intermediate, intermediate, act.data() + r * intermediate);
    }
    quantize_rows(act.data(), batch, intermediate, q);
    clock.lap(kSwiglu);
    project(q, down_w, out.data());
    for (int64_t i = 0; i < batch * size; ++i) x[i] += out[i];
    clock.lap(kDown);
  }
}

// steps run as row groups so far (q4q8_row_group_steps)
std::atomic<int64_t> row_group_steps{0};

// The rows from which a step of several sequences runs as row groups (0: never; q4q8_row_split)
std::atomic<int64_t> row_split_rows{[] {
  const char* setting = std::getenv("LOOPSTACK_ROW_SPLIT");
  return setting ? std::max<int64_t>(0, std::atoll(setting)) : int64_t{kRowSplitRows};
}()};

// Where a step splits into one group of whole sequences per thread: the first row of each group
// and the end, or just {0, batch} when it runs as one (fewer rows than row_split_rows, one sequence).
std::vector<int64_t> row_groups(const std::vector<int64_t>& row_seq, int64_t num_seqs) {
  const int64_t batch = static_cast<int64_t>(row_seq.size()), threads = std::max(1, at::get_num_threads());
  const int64_t split = row_split_rows.load(std::memory_order_relaxed);
  if (split <= 0 || batch < split || num_seqs < 2 || threads < 2) return {0, batch};
  std::vector<int64_t> bounds{0};
  for (int64_t group = 1; group < std::min(threads, num_seqs); ++group) {
    int64_t cut = batch * group / std::min(threads, num_seqs);  // even rows, moved to a sequence's start
    while (cut < batch && cut > bounds.back() && row_seq[cut] == row_seq[cut - 1]) ++cut;
    if (cut > bounds.back() && cut < batch) bounds.push_back(cut);
  }
  bounds.push_back(batch);
  return bounds;
}

}  // namespace

int64_t q4q8_row_split(int64_t rows) {
  return row_split_rows.exchange(rows < 0 ? row_split_rows.load() : rows);
}

int64_t q4q8_row_group_steps() { return row_group_steps.load(); }

// Arguments as decode_layers (decode_layers.cpp), the projections in q4q8's format: per layer,
// input norm (scaled weight, eps term), qkv (packed, dm, bias or empty), o (packed, dm), post norm
// (scaled weight, eps term), gate_up (packed, dm), down (packed, dm).
at::Tensor decode_layers_q4q8(at::Tensor hidden_in, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& kv_slots, const at::Tensor& slot_mapping,
                              const at::Tensor& block_tables, const std::vector<int64_t>& row_context_lens,
                              int64_t contiguous_start, const std::vector<at::Tensor>& layer_weights,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                              double scale, const std::vector<int64_t>& query_lens) {
  c10::InferenceMode guard;
  const int64_t num_layers = kv_slots.size(0);
  TORCH_CHECK(static_cast<int64_t>(layer_weights.size()) == num_layers * kPerLayer, "expected ", kPerLayer,
              " tensors per layer");
  TORCH_CHECK(hidden_in.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && kv_slots.is_contiguous() &&
                  (kv_slots.scalar_type() == at::kFloat || kv_slots.scalar_type() == at::kHalf),
              "float32 hidden states and rotary tables, a float32 or float16 cache");
  const bool half_cache = kv_slots.scalar_type() == at::kHalf;
  at::Tensor hidden_t = hidden_in.contiguous().clone();
  const at::Tensor cos_t = cos.contiguous(), sin_t = sin.contiguous();
  const int64_t batch = hidden_t.size(0), size = hidden_t.size(1);
  TORCH_CHECK(static_cast<int64_t>(row_context_lens.size()) == batch, "one context length per row");
  const int64_t num_seqs = static_cast<int64_t>(query_lens.size());
  std::vector<int64_t> row_seq;
  for (int64_t seq = 0; seq < num_seqs; ++seq) row_seq.insert(row_seq.end(), query_lens[seq], seq);
  TORCH_CHECK(static_cast<int64_t>(row_seq.size()) == batch, "query_lens must add up to the rows");
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const LoopInputs in{hidden_t.data_ptr<float>(), cos_t.data_ptr<float>(), sin_t.data_ptr<float>(),
                      half_cache ? nullptr : kv_slots.data_ptr<float>(),
                      half_cache ? kv_slots.data_ptr<c10::Half>() : nullptr, slots.data_ptr<int64_t>(),
                      tables.data_ptr<int64_t>(), &layer_weights, &row_seq, &row_context_lens,
                      AttendShape{batch, num_heads, num_kv_heads, head_dim, block_size, tables.size(1),
                                  contiguous_start, static_cast<float>(scale)},
                      num_layers, size, kv_slots.size(2)};
  profiled_calls += profiling;
  const std::vector<int64_t> bounds = row_groups(row_seq, num_seqs);
  const int64_t groups = static_cast<int64_t>(bounds.size()) - 1;
  if (groups == 1) {
    run_rows(in, 0, batch, true);
    return hidden_t;
  }
  row_group_steps.fetch_add(1, std::memory_order_relaxed);
  // one group of whole sequences per thread, every layer with no section in between: the matmuls
  // and attention inside run on the group's own thread (SerialSection); the profile times group 0
  parallel_chunks(groups, 1, [&](int64_t first, int64_t last) {
    const SerialSection serial;
    for (int64_t g = first; g < last; ++g) run_rows(in, bounds[g], bounds[g + 1], g == 0);
  });
  return hidden_t;
}
