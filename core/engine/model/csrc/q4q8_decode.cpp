// The decoder-layer loop of a decode step for q4q8 projections (quant.py, Int4Linear "q4q8"):
// one new token per sequence, or a few (a speculative verification).
//
// The math of DecoderLayer.forward in llama.py with float32 activations, written as plain loops
// over preallocated buffers: RMSNorm straight into the 8-bit codes the projection reads, rotary
// on the q and k heads, the K/V write, attention (attend_rows.cpp), SwiGLU. Only the matmuls and
// attention split work across threads (spin_pool.cpp); the rest is a few thousand floats per
// row. No ATen op runs between the layers: at ~4 us each, the ~20 per layer of decode_layers.cpp
// were a quarter of a SmolLM2-135M step on 2 cores. See native_decode.py for when it is used.
#include <torch/extension.h>

#include <array>
#include <chrono>
#include <cmath>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "attend_rows.h"
#include "q4q8_matmul.h"
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
  void lap(Part part) {
    if (!profiling) return;
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
  const int64_t num_layers = kv_slots.size(0), per_layer = 13;
  TORCH_CHECK(static_cast<int64_t>(layer_weights.size()) == num_layers * per_layer, "expected ", per_layer,
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
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t qkv_heads = num_heads + 2 * num_kv_heads, qkv_size = qkv_heads * head_dim;
  const int64_t kv_size = num_kv_heads * head_dim, num_slots = kv_slots.size(2), half = head_dim / 2;
  const AttendShape shape{batch, num_heads, num_kv_heads, head_dim, block_size, tables.size(1), contiguous_start,
                          static_cast<float>(scale)};
  float* x = hidden_t.data_ptr<float>();
  const float* cos_data = cos_t.data_ptr<float>();
  const float* sin_data = sin_t.data_ptr<float>();
  float* cache = half_cache ? nullptr : kv_slots.data_ptr<float>();
  c10::Half* half_cache_data = half_cache ? kv_slots.data_ptr<c10::Half>() : nullptr;
  std::vector<float> h(batch * size), qkv(batch * qkv_size), attn(batch * num_heads * head_dim), rotated(head_dim);
  std::vector<float> out, gate_up, act;
  QuantizedRows q;
  PartClock clock;
  profiled_calls += profiling;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* w = layer_weights.data() + layer * per_layer;
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
      if (half_cache) {
        to_half(k_row, kv_size, half_cache_data + k_at);
        to_half(v_row, kv_size, half_cache_data + v_at);
      } else {
        std::copy(k_row, k_row + kv_size, cache + k_at);
        std::copy(v_row, v_row + kv_size, cache + v_at);
      }
    }
    clock.lap(kRotary);
    if (half_cache)
      attend_rows_raw(shape, qkv.data(), qkv_size, half_cache_data + layer_offset,
                      half_cache_data + layer_offset + num_slots * kv_size, tables.data_ptr<int64_t>(), row_seq,
                      row_context_lens, attn.data());
    else
      attend_rows_raw(shape, qkv.data(), qkv_size, cache + layer_offset, cache + layer_offset + num_slots * kv_size,
                      tables.data_ptr<int64_t>(), row_seq, row_context_lens, attn.data());
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
  return hidden_t;
}
