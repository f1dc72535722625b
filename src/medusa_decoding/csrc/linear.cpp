// medusa::linear(x, w) = x @ w.T in float32 on the CPU, for the few rows of a MEDUSA step (1-128 tokens).
//
// Two properties stock kernels lack:
//  - each weight row is read from memory once for every 4 rows of x, and the next tile's weight rows are
//    prefetched while this one computes: a pass over 2-8 tokens costs little more than one over 1 token (on a
//    2-core Xeon, SmolLM2's linears over 1/4/8 tokens: 16.0/17.6/20.0 ms; MKL 17.0/28.0/32.4);
//  - batch invariance: every output element sums its products in the same order whatever the number of rows,
//    so a token's linear layers give it bitwise the same values in a tree pass as in a one-token pass (what is
//    left between the two is attention's rounding, ~1e-5 of a logit, as with stock kernels).
//
// medusa::linear_blocks computes the same for weights that are exactly GGUF Q4_1 or Q8_0 blocks (a model
// dequantized from such a file, as the embedded default is): per block of 32 weights w = code * d + m, with 4-bit
// codes (Q4_1) or 8-bit ones (Q8_0's q + 128, m = -128 d), d and m float16. code * d is exact in float32, so a
// block decodes to bitwise the float32 weight; each tile's weight rows are decoded into a buffer that the same
// float32 tile then reads. The output is bitwise medusa::linear's, from 0.75 (Q4_1) or 1.25 (Q8_0) bytes a weight
// instead of 4 (SmolLM2's linears over 1 token on a 2-core Ice Lake Xeon: 11.3 ms against 22.4).
//
// Written with GCC/Clang vector extensions: the compiler emits AVX-512, AVX2 or NEON for the machine it runs on.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

constexpr int64_t LANES = 16;
constexpr int64_t TILE = 4;  // rows of x and of w per tile: 16 accumulators, 8 loads for 16 FMAs
constexpr int64_t BLOCK = 32;  // weights per GGUF block

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

// y[m0:m0+MB, n0:n0+NB] for x [M, K], y [M, N] and w the NB weight rows [NB, K]; `next` is the weight rows to
// prefetch (PREFETCH: the weights come from memory, not from a decoded buffer)
template <int MB, int NB, bool PREFETCH>
void tile(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0,
          const float* next) {
  v16 acc[MB][NB] = {};
  auto step = [&](int64_t k, int64_t count) {  // inlined: count is a constant in the main loop
    v16 wv[NB], xv[MB];
    for (int j = 0; j < NB; j++) {
      wv[j] = load(w + j * K + k, count);
      if (PREFETCH) __builtin_prefetch(next + j * K + k, 0, 2);
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

template <int NB, bool PREFETCH>
void all_rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
              const float* next) {
  int64_t m = 0;
  for (; m + TILE <= M; m += TILE) tile<TILE, NB, PREFETCH>(x, w, y, K, N, m, n0, next);
  switch (M - m) {
    case 3: tile<3, NB, PREFETCH>(x, w, y, K, N, m, n0, next); break;
    case 2: tile<2, NB, PREFETCH>(x, w, y, K, N, m, n0, next); break;
    case 1: tile<1, NB, PREFETCH>(x, w, y, K, N, m, n0, next); break;
  }
}

// The weight rows [n0, n0 + rows) as float32 [rows, K]: read in place (the next tile's rows, from `next` on, are
// prefetched by `tile`), or decoded into `buffer` (prefetching the next tile's codes).
struct Float32 {
  const float* w;
  int64_t K;
  static constexpr bool in_place = true;
  const float* rows(int64_t n0, int64_t, int64_t, float*) const { return w + n0 * K; }
};

// Decoding converts DECODE_LANES codes at a time, the machine's vector width.
#ifdef __AVX512F__
constexpr int DECODE_LANES = 16;
#else
constexpr int DECODE_LANES = 8;
#endif
typedef float vd __attribute__((vector_size(4 * DECODE_LANES)));
typedef int32_t id __attribute__((vector_size(4 * DECODE_LANES)));
typedef uint16_t u16d __attribute__((vector_size(2 * DECODE_LANES)));
typedef uint8_t ud __attribute__((vector_size(DECODE_LANES), aligned(1)));

inline id widen(ud codes) {
#ifdef __AVX512F__
  return (id)_mm512_cvtepu8_epi32((__m128i)codes);  // one instruction; GCC 12 makes ~10 of the conversion below
#else
  return __builtin_convertvector(__builtin_convertvector(codes, u16d), id);  // 8 -> 32 bits directly: lane by lane
#endif
}

inline void decode(ud codes, float d, float m, float* out) {
  const vd w = __builtin_convertvector(widen(codes), vd) * d + m;
  std::memcpy(out, &w, sizeof w);
}

// codes [N, K * BITS / 8]: 8 bits, one byte a weight; 4 bits, byte i of a block holds weight i (low nibble) and
// weight i + 16 (high nibble), as GGUF's Q4_1. dm [N, K / 32, 2]: each block's d and m.
template <int BITS>
struct Blocks {
  const uint8_t* codes;
  const float* dm;
  int64_t K;
  static constexpr bool in_place = false;
  static constexpr int64_t BYTES = BLOCK * BITS / 8;  // per block
  const float* rows(int64_t n0, int64_t rows, int64_t next, float* buffer) const {
    const int64_t blocks = rows * (K / BLOCK);  // locals: the compiler reloads members after every store
    const uint8_t* c = codes + n0 * (K / BLOCK) * BYTES;
    const uint8_t* ahead = codes + next * (K / BLOCK) * BYTES;
    const float* s = dm + n0 * (K / BLOCK) * 2;
    float* out = buffer;
    for (int64_t b = 0; b < blocks; b++, c += BYTES, ahead += BYTES, s += 2, out += BLOCK) {
      if ((b * BYTES) % 64 == 0) __builtin_prefetch(ahead, 0, 2);  // once a cache line
      for (int64_t i = 0; i < BYTES; i += DECODE_LANES) {
        const ud bytes = *reinterpret_cast<const ud*>(c + i);
        if (BITS == 8) {
          decode(bytes, s[0], s[1], out + i);
        } else {
          decode(bytes & 15, s[0], s[1], out + i);
          decode(bytes >> 4, s[0], s[1], out + i + BLOCK / 2);
        }
      }
    }
    return buffer;
  }
};

template <typename Weights>
at::Tensor run(const at::Tensor& x, const Weights& weights, int64_t N) {
  const int64_t M = x.size(0), K = weights.K;
  at::Tensor y = at::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  const int64_t tiles = (N + TILE - 1) / TILE;
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> decoded(Weights::in_place ? 0 : TILE * K);
    float* buffer = decoded.data();
    for (int64_t t = begin; t < end; t++) {
      const int64_t n0 = t * TILE, rows = std::min(TILE, N - n0);
      const int64_t next = std::max<int64_t>(0, std::min(n0 + TILE, N - TILE));  // the next tile's first row
      const float* w = weights.rows(n0, rows, next, buffer);
      if (rows == TILE) {
        all_rows<TILE, Weights::in_place>(X, w, Y, M, K, N, n0, Weights::in_place ? w + (next - n0) * K : nullptr);
      } else {
        for (int64_t j = 0; j < rows; j++) all_rows<1, false>(X, w + j * K, Y, M, K, N, n0 + j, nullptr);
      }
    }
  });
  return y;
}

at::Tensor check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, op, ": x [M, K] with K = ", K);
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": float32 x only");
  return x.contiguous();
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "medusa::linear: float32 w [N, K]");
  at::Tensor xc = check_x(x, w.size(1), "medusa::linear"), wc = w.contiguous();
  return run(xc, Float32{wc.data_ptr<float>(), wc.size(1)}, wc.size(0));
}

at::Tensor linear_blocks(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& dm, int64_t bits) {
  const int64_t N = codes.size(0), K = codes.size(1) * 8 / bits;
  TORCH_CHECK((bits == 4 || bits == 8) && codes.dim() == 2 && codes.scalar_type() == at::kByte && K % BLOCK == 0,
              "medusa::linear_blocks: bits 4 or 8, uint8 codes [N, K * bits / 8], K a multiple of 32");
  TORCH_CHECK(dm.scalar_type() == at::kFloat && dm.numel() == N * (K / BLOCK) * 2,
              "medusa::linear_blocks: float32 dm [N, K / 32, 2]");
  at::Tensor xc = check_x(x, K, "medusa::linear_blocks"), cc = codes.contiguous(), dmc = dm.contiguous();
  if (bits == 4) return run(xc, Blocks<4>{cc.data_ptr<uint8_t>(), dmc.data_ptr<float>(), K}, N);
  return run(xc, Blocks<8>{cc.data_ptr<uint8_t>(), dmc.data_ptr<float>(), K}, N);
}

}  // namespace

TORCH_LIBRARY(medusa, m) {
  m.def("linear(Tensor x, Tensor w) -> Tensor");
  m.def("linear_blocks(Tensor x, Tensor codes, Tensor dm, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(medusa, CPU, m) {
  m.impl("linear", &linear);
  m.impl("linear_blocks", &linear_blocks);
}
