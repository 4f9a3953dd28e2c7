// The decoder-layer loop of a decode step (one new token per sequence, or a few: a speculative
// verification), in C++.
//
// Same ops, same order and dtypes as DecoderLayer.forward in model.py for a model whose
// projections are weight-only int4 (quant.py, Int4Linear) fed bfloat16: only the Python
// interpreter between the ~35 ATen calls of each layer is gone (~4 us each on this CPU).
// See native_decode.py for when it is used.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

struct Int4Weight {
  at::Tensor packed;
  at::Tensor scales_and_zeros;
  c10::optional<at::Tensor> bias;
};

at::Tensor int4_mm(const at::Tensor& rows, const Int4Weight& w, int64_t group_size) {
  at::Tensor out = at::_weight_int4pack_mm_for_cpu(rows.contiguous(), w.packed, group_size, w.scales_and_zeros);
  return w.bias.has_value() ? out + *w.bias : out;
}

// x * (w * sqrt(H)) / hypot(|x|, sqrt(H * eps)), as RMSNorm.forward does for float32
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& scaled_weight, const at::Tensor& eps_term) {
  return (x * scaled_weight).div_(at::linalg_vector_norm(x, 2, {-1}, /*keepdim=*/true).hypot_(eps_term));
}

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

}  // namespace

// Single-query attention of every (row, head), each alone over exactly its row's context with
// its own fixed order of operations: a row's output is the same bits whatever else is in the
// batch (see native_decode.py). Work is split by (row, head). q: [B, H, D] float32 (any row stride); kv: this layer's [2, num_slots, Hkv, D] float32
// cache; returns [B, H * D].
at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_tables,
                       const std::vector<int64_t>& row_context_lens, const std::vector<int64_t>& query_lens,
                       int64_t contiguous_start, int64_t block_size, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv.scalar_type() == at::kFloat, "float32 queries and cache");
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = kv.size(2), group = num_heads / num_kv_heads;
  const int64_t num_seqs = static_cast<int64_t>(query_lens.size());
  TORCH_CHECK(kv.is_contiguous() && q.stride(2) == 1 && q.stride(1) == head_dim, "unexpected layouts");
  std::vector<int64_t> first_row(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) first_row[s + 1] = first_row[s] + query_lens[s];
  TORCH_CHECK(first_row[num_seqs] == batch, "query_lens must add up to the rows");
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t table_width = tables.size(1);
  const float* q_data = q.data_ptr<float>();
  const int64_t q_row_stride = q.stride(0);
  const float* k_data = kv.select(0, 0).data_ptr<float>();
  const float* v_data = kv.select(0, 1).data_ptr<float>();
  const int64_t slot_stride = num_kv_heads * head_dim;
  at::Tensor out = at::zeros({batch, num_heads * head_dim}, q.options().memory_format(at::MemoryFormat::Contiguous));
  float* out_data = out.data_ptr<float>();
  const float softmax_scale = static_cast<float>(scale);
  std::vector<int64_t> row_seq(batch);
  for (int64_t seq = 0; seq < num_seqs; ++seq)
    for (int64_t row = first_row[seq]; row < first_row[seq + 1]; ++row) row_seq[row] = seq;
  at::parallel_for(0, batch * num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / num_heads, head = item % num_heads, kv_head = head / group;
      const int64_t length = row_context_lens[row];
      const int64_t* blocks = table + row_seq[row] * table_width;
      auto slot_of = [&](int64_t p) {
        return contiguous_start >= 0 ? contiguous_start + p : blocks[p / block_size] * block_size + p % block_size;
      };
      const float* query = q_data + row * q_row_stride + head * head_dim;
      scores.resize(length);
      float top = -INFINITY;
      for (int64_t p = 0; p < length; ++p) {
        scores[p] = dot(query, k_data + slot_of(p) * slot_stride + kv_head * head_dim, head_dim) * softmax_scale;
        top = scores[p] > top ? scores[p] : top;
      }
      float total = 0;
      for (int64_t p = 0; p < length; ++p) total += (scores[p] = std::exp(scores[p] - top));
      float* result = out_data + row * num_heads * head_dim + head * head_dim;
      for (int64_t p = 0; p < length; ++p) axpy(scores[p], v_data + slot_of(p) * slot_stride + kv_head * head_dim, result, head_dim);
      const float inverse = 1.0f / total;
      for (int64_t d = 0; d < head_dim; ++d) result[d] *= inverse;
    }
  });
  return out;
}


// hidden: [B, H] float32 residual stream after the embedding.
// cos, sin: [B, num_heads + 2 * num_kv_heads, head_dim] (see CausalLM._rotary).
// kv_slots: [L, 2, num_slots, num_kv_heads, head_dim] (the cache, blocks flattened).
// slot_mapping: [B] write slot of each new token.
// block_tables: [S, max_blocks], the block ids of each of the S sequences.
// row_context_lens: [B] the context each row attends over (its own position + 1).
// contiguous_start: with one sequence whose blocks are consecutive, its first slot, else -1.
// query_lens: [S] new tokens of each sequence, its rows in order (1 for a plain decode step,
// k + 1 for a speculative verification of k draft tokens).
// layer_weights: per layer, 12 tensors: input norm (scaled weight, eps term), qkv (packed,
// scales, bias or empty), o (packed, scales), post norm (scaled weight, eps term),
// gate_up (packed, scales), down (packed, scales) -- see native_decode.py.
at::Tensor decode_layers(at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_slots,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const std::vector<int64_t>& row_context_lens, int64_t contiguous_start,
                         const std::vector<at::Tensor>& layer_weights, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, int64_t group_size, double scale,
                         const std::vector<int64_t>& query_lens) {
  c10::InferenceMode guard;
  const int64_t num_layers = kv_slots.size(0);
  const int64_t per_layer = 13;
  TORCH_CHECK(static_cast<int64_t>(layer_weights.size()) == num_layers * per_layer, "expected ", per_layer,
              " tensors per layer");
  const int64_t batch = hidden.size(0);
  TORCH_CHECK(static_cast<int64_t>(row_context_lens.size()) == batch, "one context length per row");
  const auto bf16 = at::kBFloat16;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* w = layer_weights.data() + layer * per_layer;
    const Int4Weight qkv_w{w[2], w[3], w[4].defined() && w[4].numel() ? c10::optional<at::Tensor>(w[4]) : c10::nullopt};
    const Int4Weight o_w{w[5], w[6], c10::nullopt};
    const Int4Weight gate_up_w{w[9], w[10], c10::nullopt};
    const Int4Weight down_w{w[11], w[12], c10::nullopt};
    // attention
    at::Tensor h = rms_norm(hidden, w[0], w[1]).to(bf16);
    at::Tensor qkv = int4_mm(h, qkv_w, group_size).view({batch, -1, head_dim});
    qkv = at::addcmul(qkv * cos, qkv.roll({head_dim / 2}, {-1}), sin);  // float32 from here (cos is)
    at::Tensor kv = qkv.slice(1, num_heads).view({batch, 2, num_kv_heads, head_dim}).transpose(0, 1);
    at::Tensor layer_slots = kv_slots.select(0, layer);  // [2, S, Hkv, D]
    layer_slots.index_copy_(1, slot_mapping, kv);
    at::Tensor attn = attend_rows(qkv.slice(1, 0, num_heads), layer_slots, block_tables, row_context_lens,
                                  query_lens, contiguous_start, block_size, scale);  // [B, H * D]
    hidden = hidden + int4_mm(attn.to(bf16), o_w, group_size);
    // MLP (SwiGLU)
    h = rms_norm(hidden, w[7], w[8]).to(bf16);
    at::Tensor gate_up = int4_mm(h, gate_up_w, group_size);
    auto halves = gate_up.chunk(2, -1);
    hidden = hidden + int4_mm(at::silu(halves[0]) * halves[1], down_w, group_size);
  }
  return hidden;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_layers", &decode_layers, "the decoder layers of one decode step (see decode_layers.cpp)");
  m.def("attend_rows", &attend_rows, "single-query attention of every row over its own context (tests)");
}
