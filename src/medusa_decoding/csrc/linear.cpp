// medusa::linear(x, w) = x @ w.T in float32 on the CPU, for the few rows of a MEDUSA step (1-64 tokens).
//
// Two properties stock kernels lack:
//  - each weight row is read from memory once for every 4 rows of x, and the next tile's weight rows are
//    prefetched while this one computes: a pass over 2-8 tokens costs little more than one over 1 token (on a
//    2-core Xeon, SmolLM2's linears over 1/4/8 tokens: 16.0/17.6/20.0 ms; MKL 17.0/28.0/32.4);
//  - batch invariance: every output element sums its products in the same order whatever the number of rows,
//    so a token's linear layers give it bitwise the same values in a tree pass as in a one-token pass (what is
//    left between the two is attention's rounding, ~1e-5 of a logit, as with stock kernels).
// Written with GCC/Clang vector extensions: the compiler emits AVX-512, AVX2 or NEON for the machine it runs on.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

constexpr int64_t LANES = 16;
constexpr int TILE = 4;  // rows of x and of w per tile: 16 accumulators, 8 loads for 16 FMAs

// `count` floats from p, zero-padded to a vector (count < LANES only at the end of a row)
inline v16 load(const float* p, int64_t count) {
  v16 v = {};
  std::memcpy(&v, p, sizeof(float) * count);
  return v;
}

inline float sum(v16 a) {
  v8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// y[m0:m0+MB, n0:n0+NB] for x [M, K], w [N, K], y [M, N]; `next` is the weight rows to prefetch
template <int MB, int NB>
void tile(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0,
          const float* next) {
  v16 acc[MB][NB] = {};
  auto step = [&](int64_t k, int64_t count) {  // inlined: count is a constant in the main loop
    v16 wv[NB], xv[MB];
    for (int j = 0; j < NB; j++) {
      wv[j] = load(w + (n0 + j) * K + k, count);
      __builtin_prefetch(next + j * K + k, 0, 2);
    }
    for (int i = 0; i < MB; i++) xv[i] = load(x + (m0 + i) * K + k, count);
    for (int i = 0; i < MB; i++)
      for (int j = 0; j < NB; j++) acc[i][j] += xv[i] * wv[j];
  };
  int64_t k = 0;
  for (; k + LANES <= K; k += LANES) step(k, LANES);
  if (k < K) step(k, K - k);
  for (int i = 0; i < MB; i++)
    for (int j = 0; j < NB; j++) y[(m0 + i) * N + n0 + j] = sum(acc[i][j]);
}

template <int NB>
void all_rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
              const float* next) {
  int64_t m = 0;
  for (; m + TILE <= M; m += TILE) tile<TILE, NB>(x, w, y, K, N, m, n0, next);
  switch (M - m) {
    case 3: tile<3, NB>(x, w, y, K, N, m, n0, next); break;
    case 2: tile<2, NB>(x, w, y, K, N, m, n0, next); break;
    case 1: tile<1, NB>(x, w, y, K, N, m, n0, next); break;
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "medusa::linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "medusa::linear: float32 only");
  at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  at::Tensor y = at::empty({M, N}, xc.options());
  const float* X = xc.data_ptr<float>();
  const float* W = wc.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  const int64_t tiles = (N + TILE - 1) / TILE;
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      const int64_t n0 = t * TILE;
      const float* next = W + std::max<int64_t>(0, std::min(n0 + TILE, N - TILE)) * K;
      if (n0 + TILE <= N) {
        all_rows<TILE>(X, W, Y, M, K, N, n0, next);
      } else {
        for (int64_t n = n0; n < N; n++) all_rows<1>(X, W, Y, M, K, N, n, W + n * K);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(medusa, m) { m.def("linear(Tensor x, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(medusa, CPU, m) { m.impl("linear", &linear); }
