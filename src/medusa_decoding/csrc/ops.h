// The library's ops, registered by library.cpp (one copy per variant's library): defined in linear.cpp,
// attention.cpp and layer.cpp, which include the light ATen headers only (the dispatcher's, which registration needs,
// take most of a file's compile time). layer.cpp runs a decoder layer through the others directly.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace medusa {
// x [M, K] as linear_q8 takes it, quantized per block of 32 once for every linear that reads it (layer.cpp: q, k and
// v, gate and up)
struct Q8Activations {
  int64_t M, K;
  std::vector<int8_t> q;          // [M, K]
  std::vector<float> d, dt;       // [M, K / 32] each block's scale, and scale * the sum of its codes
  std::vector<int32_t> x128;      // [M, K / 32] 128 * the sum of its codes
};
at::Tensor linear(const at::Tensor& x, const at::Tensor& w);
at::Tensor linear_blocks(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& dm, int64_t bits);
at::Tensor linear_gguf(const at::Tensor& x, const at::Tensor& blocks, int64_t type);
at::Tensor dequantize_gguf(const at::Tensor& blocks, int64_t type);
at::Tensor linear_k(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t path);
Q8Activations quantize_q8(const at::Tensor& x);
// linears that read the same activations (q, k and v; gate and up) in one parallel region, their groups side by side
std::vector<at::Tensor> linear_q8(const Q8Activations& x, at::TensorList codes, at::TensorList dm, at::IntArrayRef n,
                                  int64_t path);
at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& dm, int64_t n, int64_t path);
std::vector<std::string> q8_path_names();
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                     double scale);
at::Tensor layer_q8(const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& post_norm,
                    at::TensorList codes, at::TensorList scales, at::IntArrayRef outs, const at::Tensor& keys,
                    const at::Tensor& values, const at::Tensor& columns, const at::Tensor& cos, const at::Tensor& sin,
                    const at::Tensor& mask, double eps, double scale);
}  // namespace medusa
