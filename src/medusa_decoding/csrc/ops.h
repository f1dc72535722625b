// The ops that other ops of the library call directly (layer.cpp runs a decoder layer through them): defined in
// linear.cpp and attention.cpp, one copy per variant's library.
#pragma once

#include <ATen/ATen.h>

namespace medusa {
at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& dm, int64_t n, int64_t path);
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                     double scale);
}  // namespace medusa
