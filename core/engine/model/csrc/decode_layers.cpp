// The decoder-layer loop of a decode step (one new token per sequence, or the same few new
// tokens per sequence: a speculative verification), in C++.
//
// Same ops, same order and dtypes as DecoderLayer.forward in model.py for a model whose
// projections are weight-only int4 (quant.py, Int4Linear) fed bfloat16: only the Python
// interpreter between the ~35 ATen calls of each layer is gone (~4 us each on this CPU).
// See native_decode.py for when it is used.
#include <torch/extension.h>

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

// hidden: [B, H] float32 residual stream after the embedding.
// cos, sin: [B, num_heads + 2 * num_kv_heads, head_dim] (see CausalLM._rotary).
// kv_slots: [L, 2, num_slots, num_kv_heads, head_dim] (the cache, blocks flattened).
// slot_mapping: [B] write slot of each new token.
// block_tables: [B, max_blocks]; context_len: the one sequence's context when B == 1;
// contiguous_start: its first slot when its blocks are consecutive, else -1.
// mask: [S, 1, Q, max_blocks * block_size] additive, undefined for one sequence that needs
// none (one new token, or a fresh prompt: causal).
// queries_per_seq: Q, new tokens of each of the S = B / Q sequences (1 for a plain decode).
// layer_weights: per layer, 12 tensors: input norm (scaled weight, eps term), qkv (packed,
// scales, bias or empty), o (packed, scales), post norm (scaled weight, eps term),
// gate_up (packed, scales), down (packed, scales) -- see native_decode.py.
at::Tensor decode_layers(at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_slots,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables, int64_t context_len,
                         int64_t contiguous_start, const c10::optional<at::Tensor>& mask,
                         const std::vector<at::Tensor>& layer_weights, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, int64_t group_size, double scale,
                         int64_t queries_per_seq) {
  c10::InferenceMode guard;
  const int64_t num_layers = kv_slots.size(0);
  const int64_t per_layer = 13;
  TORCH_CHECK(static_cast<int64_t>(layer_weights.size()) == num_layers * per_layer, "expected ", per_layer,
              " tensors per layer");
  const int64_t batch = hidden.size(0);
  const int64_t qlen = queries_per_seq;
  const int64_t num_seqs = batch / qlen;
  TORCH_CHECK(num_seqs * qlen == batch, "rows must be a multiple of queries_per_seq");
  const int64_t group = num_heads / num_kv_heads;
  const auto bf16 = at::kBFloat16;
  const at::Tensor table = block_tables.reshape({-1});
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
    at::Tensor k_ctx, v_ctx;
    if (contiguous_start >= 0) {
      at::Tensor ctx = layer_slots.narrow(1, contiguous_start, context_len).unsqueeze(1).transpose(-2, -3);
      k_ctx = ctx.select(0, 0);
      v_ctx = ctx.select(0, 1);
    } else {
      at::Tensor blocks = layer_slots.view({2, -1, block_size, num_kv_heads, head_dim});
      at::Tensor ctx = blocks.index_select(1, table).view({2, num_seqs, -1, num_kv_heads, head_dim}).transpose(2, 3);
      if (!mask.has_value()) ctx = ctx.narrow(3, 0, context_len);
      k_ctx = ctx.select(0, 0);
      v_ctx = ctx.select(0, 1);
    }
    at::Tensor attn;
    if (qlen == 1) {
      at::Tensor q = qkv.slice(1, 0, num_heads).view({batch, num_kv_heads, group, head_dim});
      if (mask.has_value()) {
        attn = at::scaled_dot_product_attention(q, k_ctx, v_ctx, mask->expand({batch, 1, group, mask->size(-1)}),
                                                0.0, false, scale);
      } else {
        attn = at::scaled_dot_product_attention(q, k_ctx, v_ctx, c10::nullopt, 0.0, false, scale);
      }
    } else {
      // [S, H, Q, D] queries over each sequence's context, causal among the new tokens
      at::Tensor q = qkv.slice(1, 0, num_heads).reshape({num_seqs, qlen, num_heads, head_dim}).transpose(1, 2);
      if (mask.has_value()) {
        at::Tensor m = contiguous_start >= 0 ? mask->narrow(-1, 0, context_len) : *mask;
        attn = at::scaled_dot_product_attention(q, k_ctx, v_ctx, m, 0.0, false, scale, /*enable_gqa=*/true);
      } else {
        attn = at::scaled_dot_product_attention(q, k_ctx, v_ctx, c10::nullopt, 0.0, true, scale, /*enable_gqa=*/true);
      }
      attn = attn.transpose(1, 2);  // [S, Q, H, D]
    }
    hidden = hidden + int4_mm(attn.reshape({batch, -1}).to(bf16), o_w, group_size);
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
}
