// The CPU ops a decoder layer is made of, as the fused layer
// (cpu_decoder_layer.cpp) calls them: each defined in its own file and registered
// there as a torch op of the same name and arguments.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

// cpu_layer_ops.cpp
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm(at::Tensor residual, const at::Tensor& x, const at::Tensor& weight,
                  at::Tensor out, double eps);
void silu_and_mul(at::Tensor out, const at::Tensor& x);
void rotary(at::Tensor out, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
                       at::Tensor value_cache, const at::Tensor& slot_mapping);

// cpu_paged_attention.cpp
void paged_attention_rows(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables,
                          const at::Tensor& items, double scale);

// cpu_linear_rows.cpp
void linear_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                 const std::optional<at::Tensor>& bias);
