// The ops that other ops of the library call directly (layer.cpp runs a decoder layer through them): defined in
// linear.cpp and attention.cpp, one copy per variant's library.
#pragma once

#include <ATen/ATen.h>

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
Q8Activations quantize_q8(const at::Tensor& x);
// linears that read the same activations (q, k and v; gate and up) in one parallel region, their groups side by side
std::vector<at::Tensor> linear_q8(const Q8Activations& x, at::TensorList codes, at::TensorList dm, at::IntArrayRef n,
                                  int64_t path);
at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& dm, int64_t n, int64_t path);
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                     double scale);
}  // namespace medusa
