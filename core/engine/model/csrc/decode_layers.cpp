// The decoder-layer loop of a decode step (one new token per sequence, or a few: a speculative
// verification), in C++.
//
// Same ops, same order and dtypes as DecoderLayer.forward in llama.py for a model whose
// projections are weight-only int4 on torch's kernel (quant.py, Int4Linear "int4pack") fed
// bfloat16: only the Python interpreter between the ~35 ATen calls of each layer is gone (~4 us
// each on this CPU). The q4q8 projections have a loop of their own (q4q8_decode.cpp). See
// native_decode.py for when each is used.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "attend_rows.h"
#include "q4q8_amx.h"
#include "q4q8_matmul.h"

#include <vector>

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

}  // namespace

// Single-query attention of every (row, head), each alone over exactly its row's context with
// its own fixed order of operations: a row's output is the same bits whatever else is in the
// batch (see native_decode.py). Work is split by (row, head). q: [B, H, D] float32 (any row
// stride); kv: this layer's [2, num_slots, Hkv, D] float32 or float16 cache; returns [B, H * D].
at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_tables,
                       const std::vector<int64_t>& row_context_lens, const std::vector<int64_t>& query_lens,
                       int64_t contiguous_start, int64_t block_size, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && (kv.scalar_type() == at::kFloat || kv.scalar_type() == at::kHalf),
              "float32 queries, a float32 or float16 cache");
  const int64_t batch = q.size(0), num_seqs = static_cast<int64_t>(query_lens.size());
  TORCH_CHECK(kv.is_contiguous() && q.stride(2) == 1 && q.stride(1) == q.size(2), "unexpected layouts");
  std::vector<int64_t> row_seq;
  for (int64_t seq = 0; seq < num_seqs; ++seq) row_seq.insert(row_seq.end(), query_lens[seq], seq);
  TORCH_CHECK(static_cast<int64_t>(row_seq.size()) == batch, "query_lens must add up to the rows");
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const AttendShape shape{batch, q.size(1), kv.size(2), q.size(2), block_size, tables.size(1), contiguous_start,
                          static_cast<float>(scale)};
  at::Tensor out = at::empty({batch, q.size(1) * q.size(2)}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (kv.scalar_type() == at::kHalf)
    attend_rows_raw(shape, q.data_ptr<float>(), q.stride(0), kv.select(0, 0).data_ptr<c10::Half>(),
                    kv.select(0, 1).data_ptr<c10::Half>(), tables.data_ptr<int64_t>(), row_seq, row_context_lens,
                    out.data_ptr<float>());
  else
    attend_rows_raw(shape, q.data_ptr<float>(), q.stride(0), kv.select(0, 0).data_ptr<float>(),
                    kv.select(0, 1).data_ptr<float>(), tables.data_ptr<int64_t>(), row_seq, row_context_lens,
                    out.data_ptr<float>());
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
    layer_slots.index_copy_(1, slot_mapping, kv.to(layer_slots.scalar_type()));
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

at::Tensor decode_layers_q4q8(at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& kv_slots, const at::Tensor& slot_mapping,
                              const at::Tensor& block_tables, const std::vector<int64_t>& row_context_lens,
                              int64_t contiguous_start, const std::vector<at::Tensor>& layer_weights,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                              double scale, const std::vector<int64_t>& query_lens);  // q4q8_decode.cpp
std::vector<double> q4q8_decode_profile(bool enable, bool reset);                     // q4q8_decode.cpp
int64_t q4q8_row_split(int64_t rows);                                                 // q4q8_decode.cpp
int64_t q4q8_row_group_steps();                                                       // q4q8_decode.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while they run: the server's event loop streams tokens meanwhile
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("decode_layers", &decode_layers, "the decoder layers of one decode step (see decode_layers.cpp)", no_gil);
  m.def("decode_layers_q4q8", &decode_layers_q4q8, "the same for q4q8 projections (see q4q8_decode.cpp)", no_gil);
  m.def("q4q8_decode_profile", &q4q8_decode_profile, py::arg("enable"), py::arg("reset") = true,
        "seconds decode_layers_q4q8 spent per part (norms and quantizing, qkv, rotary and the K/V write, "
        "attention, o, gate_up, SwiGLU, down) and the calls, since the last reset; enable: keep timing");
  m.def("attend_rows", &attend_rows, "single-query attention of every row over its own context (tests)", no_gil);
  m.def("q4q8_matmul", &q4q8_matmul, "4- or 8-bit weights x rows as two int8 digits (see q4q8_matmul.cpp)",
        no_gil);
  m.def("q4q8_is_vectorized", &q4q8_is_vectorized, "whether q4q8_matmul runs a vector kernel (AVX-512 VNNI or AVX2)");
  m.def("q4q8_instruction_set", &q4q8_instruction_set,
        "which kernel q4q8_matmul runs: avx512_vnni+amx, avx512_vnni, avx2 or scalar");
  m.def("q4q8_prefetch", &q4q8_prefetch, py::arg("bytes"),
        "how far ahead (bytes of codes) the q4q8 kernels prefetch weights, 0: not at all; returns the setting before");
  m.def("q4q8_row_split", &q4q8_row_split, py::arg("rows"),
        "decode steps of at least this many rows over several sequences run one group of sequences per thread "
        "(0: never; negative: leave it); returns the setting before");
  m.def("q4q8_row_group_steps", &q4q8_row_group_steps, "decode steps run as row groups so far");
  m.def("q4q8_use_amx", &q4q8_use_amx, py::arg("enabled"),
        "allow (or not) the AMX kernel for inputs of several rows; returns whether it is in use now");
}
