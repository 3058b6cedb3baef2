// A whole Llama-family decoder layer on a CPU in one call, for the engine's CPU
// fast path (testbed/engine/cpu_layer_ops.py): the residual add and input norm,
// the fused q/k/v product, the rotary embedding, the K/V cache write, paged
// attention through the block table, the output product, the residual add and
// post-attention norm, the gate/up product, silu(gate) * up and the down product.
//
// The same ops the model runs one by one from Python (cpu_ops.h; linear products
// through oneDNN's packed weights, or the C++ kernel for a few rows), in the same
// order and precision, so its results are theirs bit for bit; what it saves is the
// Python between them: about 14 op calls a layer, their argument parsing and the
// module calls around them (a decode forward of the dummy Llama in 0.73-0.87x the
// time, docs/engine_vs_vllm.md).
//
// Arguments, all of one layer:
// - residual [tokens, hidden]: the residual stream, updated in place; h: the
//   previous layer's output, added to it first (None for the first layer: the
//   input norm reads the residual as it is);
// - norms: the input and post-attention RMSNorm weights; eps;
// - onednn, rows, biases, out_features: the q/k/v, o, gate/up and down products
//   (oneDNN's packed weight; the row kernel's packed weight or None; the bias or
//   None; the product's output width), rows up to max_rows to the row kernel;
// - num_heads, num_kv_heads; cos, sin: float32 [tokens, head_dim];
// - key_cache, value_cache, slot_mapping (int64), block_tables (int32) and items
//   (the kernel's, covering every row): as paged_attention_rows takes them;
// - attention_seconds: where given (float64 [1]), the attention kernel's wall time
//   is added to it, for profilers that split a step's time.
// Returns the layer's output, which the next layer (or the final norm) adds to
// the residual.

#include "cpu_ops.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>({std::nullopt}),
                 c10::string_view(""));
}

// x @ W^T (+ b) for product i: the row kernel up to max_rows rows where it has W.
at::Tensor product(const at::Tensor& x, int64_t i, const std::vector<at::Tensor>& onednn,
                   const std::vector<std::optional<at::Tensor>>& rows,
                   const std::vector<std::optional<at::Tensor>>& biases,
                   const std::vector<int64_t>& out_features, int64_t max_rows) {
  if (rows[i].has_value() && x.size(0) <= max_rows) {
    at::Tensor out = at::empty({x.size(0), out_features[i]}, x.options());
    linear_rows(out, x, *rows[i], biases[i]);
    return out;
  }
  return onednn_linear(x, onednn[i], biases[i]);
}

}  // namespace

at::Tensor decoder_layer(at::Tensor residual, const std::optional<at::Tensor>& h,
                         std::vector<at::Tensor> norms, double eps, std::vector<at::Tensor> onednn,
                         std::vector<std::optional<at::Tensor>> rows,
                         std::vector<std::optional<at::Tensor>> biases,
                         std::vector<int64_t> out_features, int64_t max_rows, int64_t num_heads,
                         int64_t num_kv_heads, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor key_cache, at::Tensor value_cache,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& items, double scale,
                         std::optional<at::Tensor> attention_seconds) {
  TORCH_CHECK(norms.size() == 2 && onednn.size() == 4 && rows.size() == 4 && biases.size() == 4 &&
                  out_features.size() == 4,
              "decoder_layer: 2 norms and 4 products (q/k/v, o, gate/up, down)");
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(),
              "decoder_layer: residual [tokens, hidden], contiguous");
  const int64_t tokens = residual.size(0), head_dim = key_cache.size(3);
  const int64_t q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
  TORCH_CHECK(out_features[0] == q_width + 2 * kv_width,
              "decoder_layer: the q/k/v product's width is not the heads'");
  const auto linear = [&](const at::Tensor& x, int64_t i) {
    return product(x, i, onednn, rows, biases, out_features, max_rows);
  };

  at::Tensor x = at::empty_like(residual);
  if (h.has_value()) {
    add_rms_norm(residual, *h, norms[0], x, eps);
  } else {
    rms_norm(x, residual, norms[0], eps);
  }
  const at::Tensor qkv = linear(x, 0);
  const auto heads = [&](int64_t start, int64_t width, int64_t n) {
    return qkv.narrow(1, start, width).view({tokens, n, head_dim});
  };
  at::Tensor q = at::empty({tokens, num_heads, head_dim}, qkv.options());
  at::Tensor k = at::empty({tokens, num_kv_heads, head_dim}, qkv.options());
  rotary(q, heads(0, q_width, num_heads), cos, sin);
  rotary(k, heads(q_width, kv_width, num_kv_heads), cos, sin);
  reshape_and_cache(k, heads(q_width + kv_width, kv_width, num_kv_heads), key_cache, value_cache,
                    slot_mapping);

  at::Tensor attn = at::empty_like(q);
  const auto t0 = std::chrono::steady_clock::now();
  paged_attention_rows(attn, q, key_cache, value_cache, block_tables, items, scale);
  if (attention_seconds.has_value()) {
    const std::chrono::duration<double> spent = std::chrono::steady_clock::now() - t0;
    attention_seconds->add_(spent.count());
  }

  const at::Tensor o = linear(attn.view({tokens, q_width}), 1);
  at::Tensor x2 = at::empty_like(residual);
  add_rms_norm(residual, o, norms[1], x2, eps);
  const at::Tensor gate_up = linear(x2, 2);
  at::Tensor act = at::empty({tokens, gate_up.size(1) / 2}, gate_up.options());
  silu_and_mul(act, gate_up);
  return linear(act, 3);
}

TORCH_LIBRARY_FRAGMENT(testbed_cpu, m) {
  m.def(
      "decoder_layer(Tensor(a!) residual, Tensor? h, Tensor[] norms, float eps, Tensor[] onednn, "
      "Tensor?[] rows, Tensor?[] biases, int[] out_features, int max_rows, int num_heads, "
      "int num_kv_heads, Tensor cos, Tensor sin, Tensor(b!) key_cache, Tensor(c!) value_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor items, float scale, "
      "Tensor(d!)? attention_seconds) -> Tensor",
      &decoder_layer);
}
