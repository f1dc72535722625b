// medusa::layer_q8: one decoder layer of a Llama-shaped model (RMSNorm, attention with rotary positions, RMSNorm,
// SiLU-gated MLP, both residual) over a step's few tokens, in one call: the q8 linears of linear.cpp, the invariant
// attention of attention.cpp, and the small work between them in C++. `transformers`' layer makes ~40 small ops
// of it, each a Python call and a dispatch; on a 2-core CPU those cost more than SmolLM2's q8 arithmetic. Every
// token's arithmetic is its own, so the layer is batch-invariant as its parts are (a tree node gets bitwise what a
// one-token pass gives it), and simd.h's exp gives the same bits on every variant.
//
// x [B, T, H]; norms [H]; codes, scales: the q8 packs (kernels.q8_pack) of q, k, v, o, gate, up, down and `outs`
// their output sizes; keys and values: the cache's float16 buffers [slots, Hkv, capacity, D], where row b's token t is
// written at column columns[b, t] before the attention reads columns 0..S-1 under mask [B, T, S] (additive, 0:
// seen); cos, sin [B, T, D]: the rotary embedding at the tokens' positions (the model's own, any scaling).

#include <cmath>
#include <cstdint>

#include "ops.h"
#include "simd.h"

namespace {

using namespace simd;

constexpr int64_t LANES = 16;

// x * rsqrt(mean(x^2) + eps) * w, row by row
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t M = x.size(0), H = x.size(1);
  at::Tensor y = x.new_empty(x.sizes());
  const float *X = x.data_ptr<float>(), *Wt = w.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  for (int64_t r = 0; r < M; r++, X += H, Y += H) {
    float squares = 0;
    for (int64_t j = 0; j < H; j++) squares += X[j] * X[j];
    const float inverse = 1 / std::sqrt(squares / float(H) + float(eps));
    for (int64_t j = 0; j < H; j++) Y[j] = Wt[j] * (X[j] * inverse);
  }
  return y;
}

// x [M, heads * D] in place: x * cos + rotate_half(x) * sin per head, rotate_half(x) = [-x2, x1] (`transformers`')
void rotate(at::Tensor& x, int64_t heads, const float* cos, const float* sin, int64_t D) {
  const int64_t M = x.size(0), half = D / 2;
  float* X = x.data_ptr<float>();
  for (int64_t r = 0; r < M; r++)
    for (int64_t h = 0; h < heads; h++) {
      float* v = X + (r * heads + h) * D;
      const float *c = cos + r * D, *s = sin + r * D;
      for (int64_t i = 0; i < half; i++) {  // the pair (i, i + half) in registers, not a copy of the head
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] + -b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
}

// gate <- silu(gate) * up, 16 lanes at a time: silu(g) = g * sigmoid(g), the sigmoid from e^-|g| (simd.h's exp takes
// x <= 0). Vectors throughout (the divisions too): it runs on one core while the other waits for the next linear
FMA_CLONES void silu_times(at::Tensor& gate, const at::Tensor& up) {
  float* G = gate.data_ptr<float>();
  const float* U = up.data_ptr<float>();
  const int64_t n = gate.numel();
  for (int64_t i = 0; i < n; i += LANES) {
    const int64_t count = std::min<int64_t>(LANES, n - i);
    F16 g = load16(G + i, count);
    const F16 u = load16(U + i, count);
    for (int p = 0; p < P; p++) {
      const V e = exp(-abs(g.p[p]));
      g.p[p] = g.p[p] * (g.p[p] >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e)) * u.p[p];
    }
    store16(G + i, g, count);
  }
}

}  // namespace

namespace medusa {

at::Tensor layer_q8(const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& post_norm,
                    at::TensorList codes, at::TensorList scales, at::IntArrayRef outs, const at::Tensor& keys,
                    const at::Tensor& values,
                    const at::Tensor& columns, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& mask,
                    double eps, double scale) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "medusa::layer_q8: float32 x [B, T, H]");
  TORCH_CHECK(codes.size() == 7 && scales.size() == 7 && outs.size() == 7,
              "medusa::layer_q8: codes, scales and outs of q, k, v, o, gate, up, down");
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), M = B * T, D = keys.size(3), Hkv = keys.size(1);
  const int64_t heads = outs[0] / D, S = mask.size(2);
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.is_contiguous() && values.is_contiguous() &&
              keys.scalar_type() == at::kHalf && values.scalar_type() == at::kHalf && keys.size(0) >= B &&
              S <= keys.size(2) && outs[1] == Hkv * D && outs[2] == Hkv * D,
              "medusa::layer_q8: float16 keys and values [slots >= B, Hkv, capacity >= S, D], k and v Hkv * D wide");
  TORCH_CHECK(columns.sizes() == at::IntArrayRef({B, T}) && columns.scalar_type() == at::kLong &&
              cos.sizes() == at::IntArrayRef({B, T, D}) && sin.sizes() == cos.sizes() &&
              mask.sizes() == at::IntArrayRef({B, T, S}), "medusa::layer_q8: columns [B, T], cos and sin [B, T, D], "
              "mask [B, T, S]");
  const at::Tensor residual = x.reshape({M, H}), cc = cos.contiguous(), sc = sin.contiguous();
  const at::Tensor cols = columns.contiguous();  // held: data_ptr of a temporary copy would dangle
  auto linears = [&](const medusa::Q8Activations& in, int first, int count) {  // codes[first : first + count]
    return medusa::linear_q8(in, codes.slice(first, count), scales.slice(first, count), outs.slice(first, count), -1);
  };
  auto linear = [&](const medusa::Q8Activations& in, int i) { return linears(in, i, 1)[0]; };

  medusa::Q8Activations h = medusa::quantize_q8(rms_norm(residual, input_norm, eps));
  std::vector<at::Tensor> qkv = linears(h, 0, 3);
  at::Tensor &q = qkv[0], &k = qkv[1], &v = qkv[2];
  rotate(q, heads, cc.data_ptr<float>(), sc.data_ptr<float>(), D);
  rotate(k, Hkv, cc.data_ptr<float>(), sc.data_ptr<float>(), D);
  const int64_t* column = cols.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; r++)  // token r of row r / T: each kv head's key and value to its column, rounded
    for (int64_t g = 0; g < Hkv; g++) {  // to float16 as torch's conversion rounds (to nearest, ties to even)
      const int64_t at = ((r / T * Hkv + g) * keys.size(2) + column[r]) * D;
      std::copy_n(k.data_ptr<float>() + (r * Hkv + g) * D, D, keys.data_ptr<at::Half>() + at);
      std::copy_n(v.data_ptr<float>() + (r * Hkv + g) * D, D, values.data_ptr<at::Half>() + at);
    }
  const at::Tensor seen_keys = keys.narrow(0, 0, B).narrow(2, 0, S);
  const at::Tensor seen_values = values.narrow(0, 0, B).narrow(2, 0, S);
  const at::Tensor attended = medusa::attention(q.view({B, T, heads, D}).transpose(1, 2), seen_keys, seen_values,
                                                mask, scale);
  at::Tensor out = residual.add(linear(medusa::quantize_q8(attended.view({M, heads * D})), 3));

  h = medusa::quantize_q8(rms_norm(out, post_norm, eps));
  std::vector<at::Tensor> gate_up = linears(h, 4, 2);
  at::Tensor& gate = gate_up[0];
  silu_times(gate, gate_up[1]);
  out += linear(medusa::quantize_q8(gate), 6);
  return out.view({B, T, H});
}

}  // namespace medusa
