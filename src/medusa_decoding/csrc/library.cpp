// The ops' schemas and their CPU implementations (ops.h), registered with the dispatcher under MEDUSA_OPS: one
// namespace per instruction-set variant (medusa_avx2, ...), so that all load side by side.
#include <torch/library.h>

#include <string>

#include "ops.h"
#include "simd.h"

namespace {

std::string variant() { return simd::VARIANT; }

}  // namespace

TORCH_LIBRARY(MEDUSA_OPS, m) {
  m.def("variant() -> str", &variant);
  m.def("q8_path_names() -> str[]", &medusa::q8_path_names);
  m.def("linear(Tensor x, Tensor w) -> Tensor");
  m.def("linear_blocks(Tensor x, Tensor codes, Tensor dm, int bits) -> Tensor");
  m.def("linear_gguf(Tensor x, Tensor blocks, int type) -> Tensor");
  m.def("dequantize_gguf(Tensor blocks, int type) -> Tensor");
  m.def("linear_k(Tensor x, Tensor blocks, int type, int path) -> Tensor");
  m.def("linear_q8(Tensor x, Tensor codes, Tensor dm, int n, int path) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  m.def("layer_q8(Tensor x, Tensor input_norm, Tensor post_norm, Tensor[] codes, Tensor[] scales, int[] outs, "
        "Tensor(a!) keys, Tensor(b!) values, Tensor columns, Tensor cos, Tensor sin, Tensor mask, float eps, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(MEDUSA_OPS, CPU, m) {
  m.impl("linear", &medusa::linear);
  m.impl("linear_blocks", &medusa::linear_blocks);
  m.impl("linear_gguf", &medusa::linear_gguf);
  m.impl("dequantize_gguf", &medusa::dequantize_gguf);
  m.impl("linear_k", &medusa::linear_k);
  m.impl("linear_q8", static_cast<at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                                  int64_t)>(&medusa::linear_q8));  // the op: on float32 x
  m.impl("attention", &medusa::attention);
  m.impl("layer_q8", &medusa::layer_q8);
}
