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
// block decodes to bitwise the float32 weight. Over up to 8 tokens (a MEDUSA step) the weights are decoded in
// registers and multiplied at once; over more, each tile's weight rows are decoded into a buffer that the same
// float32 tile then reads. Both sum every product in medusa::linear's order: the output is bitwise its, from 0.75
// (Q4_1) or 1.25 (Q8_0) bytes a weight instead of 4. SmolLM2's 211 linears on a 2-core EPYC (Zen 4), 1 / 2 / 4 /
// 5 / 8 tokens: 7.8 / 8.8 / 11.0 / 13.5 / 19.1 ms in registers, 9.5 / 13.0 / 14.7 / 17.3 / 21.2 through the buffer.
//
// Written with GCC/Clang vector extensions: the compiler emits AVX-512, AVX2 or NEON for the machine it runs on.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

constexpr int64_t LANES = 16;
constexpr int64_t TILE = 4;  // rows of x and of w per tile: 16 accumulators, 8 loads for 16 FMAs
constexpr int64_t BLOCK = 32;  // weights per GGUF block
constexpr int64_t DECODING_ROWS = 8;  // up to here blocks are decoded in registers, for all the tokens at once

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
typedef uint8_t ud __attribute__((vector_size(DECODE_LANES), aligned(1)));
typedef int32_t id16 __attribute__((vector_size(4 * LANES)));
typedef uint8_t u8v __attribute__((vector_size(LANES)));

// unsigned 8-bit codes U to the int32 lanes I (as many)
template <typename I, typename U>
inline I widen(U codes) {
#ifdef __AVX512F__
  if constexpr (sizeof(I) == 64) return (I)_mm512_cvtepu8_epi32((__m128i)codes);  // GCC 12 makes ~10 of the below
#endif
  typedef uint16_t u16 __attribute__((vector_size(sizeof(I) / 2)));
  return __builtin_convertvector(__builtin_convertvector(codes, u16), I);  // 8 -> 32 bits directly: lane by lane
}

inline void decode(ud codes, float d, float m, float* out) {
  const vd w = __builtin_convertvector(widen<id>(codes), vd) * d + m;
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

// y[0:M, n0:n0+NB] for M <= DECODING_ROWS tokens, the weight rows decoded in registers as they are multiplied: a buffer
// written and read back costs more than the products over so few tokens (a 512-bit store a 16 weights). Each
// accumulator sums the same products in the same order as `tile` does over a decoded buffer: the same bits.
template <int MB, int NB, int BITS>
void tile_decoding(const float* x, const Blocks<BITS>& w, float* y, int64_t N, int64_t n0) {
  const int64_t K = w.K, blocks = K / BLOCK;
  v16 acc[MB][NB] = {};
  for (int64_t b = 0; b < blocks; b++) {
    v16 lo[NB], hi[NB];  // the block's weights 0-15 and 16-31 of each row
    for (int j = 0; j < NB; j++) {
      const uint8_t* c = w.codes + ((n0 + j) * blocks + b) * Blocks<BITS>::BYTES;
      const float* s = w.dm + ((n0 + j) * blocks + b) * 2;
      if ((b * Blocks<BITS>::BYTES) % 64 == 0) __builtin_prefetch(c + TILE * blocks * Blocks<BITS>::BYTES, 0, 2);
      if ((b * 8) % 64 == 0) __builtin_prefetch(s + TILE * blocks * 2, 0, 2);  // the next tile's row j
      u8v first, second;
      std::memcpy(&first, c, LANES);
      if (BITS == 8) {
        std::memcpy(&second, c + LANES, LANES);
      } else {
        second = first >> 4, first &= 15;
      }
      lo[j] = __builtin_convertvector(widen<id16>(first), v16) * s[0] + s[1];
      hi[j] = __builtin_convertvector(widen<id16>(second), v16) * s[0] + s[1];
    }
    for (int i = 0; i < MB; i++) {
      const v16 xlo = load(x + i * K + b * BLOCK, LANES), xhi = load(x + i * K + b * BLOCK + LANES, LANES);
      for (int j = 0; j < NB; j++) acc[i][j] += xlo * lo[j];
      for (int j = 0; j < NB; j++) acc[i][j] += xhi * hi[j];
    }
  }
  for (int i = 0; i < MB; i++)
    for (int j = 0; j < NB; j++) y[i * N + n0 + j] = sum(acc[i][j]);
}

// the weight rows [n0, n0 + TILE), NB at a time: MB x NB accumulators and NB rows' weights fit the 32 registers
template <int MB, int BITS>
void rows_decoding(const float* x, const Blocks<BITS>& w, float* y, int64_t N, int64_t n0) {
  constexpr int NB = MB <= 4 ? 4 : 2;
  const int64_t end = std::min(n0 + TILE, N);
  int64_t n = n0;
  for (; n + NB <= end; n += NB) tile_decoding<MB, NB, BITS>(x, w, y, N, n);
  for (; n < end; n++) tile_decoding<MB, 1, BITS>(x, w, y, N, n);
}

template <int BITS>
at::Tensor run_decoding(const at::Tensor& x, const Blocks<BITS>& weights, int64_t N) {
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, (N + TILE - 1) / TILE, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      switch (M) {
        case 1: rows_decoding<1, BITS>(X, weights, Y, N, t * TILE); break;
        case 2: rows_decoding<2, BITS>(X, weights, Y, N, t * TILE); break;
        case 3: rows_decoding<3, BITS>(X, weights, Y, N, t * TILE); break;
        case 4: rows_decoding<4, BITS>(X, weights, Y, N, t * TILE); break;
        case 5: rows_decoding<5, BITS>(X, weights, Y, N, t * TILE); break;
        case 6: rows_decoding<6, BITS>(X, weights, Y, N, t * TILE); break;
        case 7: rows_decoding<7, BITS>(X, weights, Y, N, t * TILE); break;
        default: rows_decoding<8, BITS>(X, weights, Y, N, t * TILE); break;
      }
    }
  });
  return y;
}

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
  auto go = [&](const auto& blocks) {
    return 0 < xc.size(0) && xc.size(0) <= DECODING_ROWS ? run_decoding(xc, blocks, N) : run(xc, blocks, N);
  };
  if (bits == 4) return go(Blocks<4>{cc.data_ptr<uint8_t>(), dmc.data_ptr<float>(), K});
  return go(Blocks<8>{cc.data_ptr<uint8_t>(), dmc.data_ptr<float>(), K});
}

// ---------------------------------------------------------------------------------------------------------------
// medusa::linear_q8(x, codes, dm, bits, path) approximates linear_blocks as llama.cpp does: each token's activations
// are quantized per block of 32 to int8 (scale amax / 127), each block's dot product with the weight codes is summed
// in integers, and the blocks are scaled and accumulated in float32. Integer sums are exact whatever the
// instructions; every path (scalar, AVX2, AVX-VNNI, AVX-512 VNNI: chosen at run time, or forced) puts the same sums
// in the same 16 lanes (even blocks 0-7, odd blocks 8-15: AVX-512 takes two blocks an instruction) and accumulates
// them in the same order with fused multiply-adds: all paths give the same bits, and a token's output does not
// depend on the tokens beside it. A pair of blocks' weight codes is unpacked once for up to 4 tokens.

typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1)));
typedef uint8_t u8x32 __attribute__((vector_size(32), aligned(1)));
typedef uint8_t u8x64 __attribute__((vector_size(64)));
typedef int8_t s8x64 __attribute__((vector_size(64), aligned(1)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x16 __attribute__((vector_size(64)));

constexpr int Q8_TILE = 4;  // tokens per unpacked pair of weight blocks
constexpr int PAIR = 2 * BLOCK;

typedef uint8_t u8x32v __attribute__((vector_size(32)));

// a block's 32 Q4_1 codes in weight order: the low nibbles are weights 0-15, the high ones 16-31
inline u8x32v nibbles(const uint8_t* c) {
  const u8x16 v = *reinterpret_cast<const u8x16*>(c);
  return __builtin_shufflevector(v & 15, v >> 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19,
                                 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
}

// two blocks' 64 codes in weight order, unsigned: Q4_1's nibbles, or Q8_0's bytes (q + 128). `second` false: only
// the first block (a row's odd last block), the rest zero.
template <int BITS>
inline u8x64 unpack(const uint8_t* c, bool second) {
  u8x32v first, next = {};
  if (BITS == 8) {
    first = *reinterpret_cast<const u8x32*>(c);
    if (second) next = *reinterpret_cast<const u8x32*>(c + BLOCK);
  } else {
    first = nibbles(c);
    if (second) next = nibbles(c + BLOCK / 2);
  }
  return __builtin_shufflevector(first, next, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                                 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42,
                                 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63);
}

// Each path: prepare(codes) the pair's 64 codes as `unpack` gives them; lane l of dot(w, x) = the sum of w[j] * x[j]
// over j = 4l .. 4l + 3, for Q4_1's codes w < 16 and x signed in [-127, 127]; for Q8_0's (w = q + 128) the lane minus
// 128 times the sum of its 4 x (`x128`, given); fma(a, b, acc) lane by lane, fused.
struct Unpacked {
  template <int BITS>
  static u8x64 prepare(const uint8_t* c, bool second) { return unpack<BITS>(c, second); }
};

struct Scalar : Unpacked {
  static i32x16 dot(u8x64 w, const int8_t* x, const int32_t* x128) {
    i32x16 lanes = {};
    for (int j = 0; j < PAIR; j++) lanes[j / 4] += int32_t(w[j]) * int32_t(x[j]);
    for (int l = 0; x128 && l < 16; l++) lanes[l] -= x128[l];
    return lanes;
  }
  static f32x16 fma(f32x16 a, f32x16 b, f32x16 acc) {
    for (int l = 0; l < 16; l++) acc[l] = std::fma(a[l], b[l], acc[l]);
    return acc;
  }
};

#if defined(__x86_64__)
__attribute__((target("avx2"))) inline __m256i half(u8x64 w, int h) {
  return h ? (__m256i)__builtin_shufflevector(w, w, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48,
                                             49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63)
           : (__m256i)__builtin_shufflevector(w, w, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18,
                                             19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
}

#define Q8_FMA_256                                                                                              \
  static f32x16 fma(f32x16 a, f32x16 b, f32x16 acc) {                                                          \
    f32x16 out;                                                                                                 \
    for (int h = 0; h < 2; h++) {                                                                               \
      const __m256 r = _mm256_fmadd_ps(_mm256_loadu_ps(&a[8 * h]), _mm256_loadu_ps(&b[8 * h]),                   \
                                       _mm256_loadu_ps(&acc[8 * h]));                                           \
      _mm256_storeu_ps(&out[8 * h], r);                                                                         \
    }                                                                                                           \
    return out;                                                                                                 \
  }

// AVX2: pairs of u8 x s8 products to int16 (w < 256 and |x| <= 127 could saturate: Q8_0's w are split as 128 + q
// first, |q| <= 128: products fit), then to int32
struct Avx2 : Unpacked {
  __attribute__((target("avx2,fma"))) static i32x16 dot(u8x64 w, const int8_t* x, const int32_t* x128) {
    i32x16 lanes;
    for (int h = 0; h < 2; h++) {
      __m256i a = half(w, h), b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * h)), r;
      if (x128) {  // w * x = |q| * (x signed as q), q = w - 128
        a = _mm256_xor_si256(a, _mm256_set1_epi8(char(0x80)));
        b = _mm256_sign_epi8(b, a), a = _mm256_abs_epi8(a);
      }
      r = _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&lanes[8 * h]), r);
    }
    return lanes;  // Q8_0: q * x already, what the other paths get by subtracting x128
  }
  __attribute__((target("avx2,fma"))) Q8_FMA_256
};

struct AvxVnni : Unpacked {
  __attribute__((target("avx2,fma,avxvnni"))) static i32x16 dot(u8x64 w, const int8_t* x, const int32_t* x128) {
    i32x16 lanes;
    for (int h = 0; h < 2; h++) {
      const __m256i a = half(w, h);
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * h));
      __m256i r = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b);
      if (x128) r = _mm256_sub_epi32(r, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x128 + 8 * h)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&lanes[8 * h]), r);
    }
    return lanes;
  }
  __attribute__((target("avx2,fma"))) Q8_FMA_256
};

#define AVX512 "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni"
struct Avx512Vnni {
  template <int BITS>
  __attribute__((target(AVX512))) static u8x64 prepare(const uint8_t* c, bool second) {
    if (BITS == 8 || !second) return unpack<BITS>(c, second);
    // 32 bytes = two blocks' nibbles: each 16 bytes twice, shifted by 0 and 4, masked
    const __m512i v = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
                                               _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)c)));
    return (u8x64)_mm512_and_si512(_mm512_srlv_epi64(v, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)),
                                   _mm512_set1_epi8(15));
  }
  __attribute__((target(AVX512))) static i32x16 dot(u8x64 w, const int8_t* x, const int32_t* x128) {
    __m512i r = _mm512_dpbusd_epi32(_mm512_setzero_si512(), (__m512i)w, _mm512_loadu_si512(x));
    if (x128) r = _mm512_sub_epi32(r, _mm512_loadu_si512(x128));
    return (i32x16)r;
  }
  __attribute__((target(AVX512))) static f32x16 fma(f32x16 a, f32x16 b, f32x16 acc) {
    return (f32x16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
  }
};
#endif

struct Q8 {
  const int8_t* xq;    // [M, K] the tokens' quantized activations
  const float* xd;     // [M, K / 32, 8] each block's scale, 8 times (a lane per 4 codes)
  const float* xdt;    // [M, S] scale * sum of the block's codes (Q4_1's offset term), S = K / 32 rounded up to 16
  const int32_t* x128; // [M, K / 8] 128 * the sum of each 4 codes (Q8_0's w = q + 128)
  const uint8_t* codes;
  const float* dm;
  float* y;
  int64_t K, N, S;
};

inline float sum16(f32x16 s) {  // lanes l and l + 8 first: a pair's two blocks
  return (((s[0] + s[8]) + (s[4] + s[12])) + ((s[2] + s[10]) + (s[6] + s[14]))) +
         (((s[1] + s[9]) + (s[5] + s[13])) + ((s[3] + s[11]) + (s[7] + s[15])));
}

typedef float f32x8 __attribute__((vector_size(32)));

// a pair of blocks' values in 8 lanes each: the first's, then the second's
inline f32x16 spread(float first, float second) {
  const f32x8 a = f32x8{} + first, b = f32x8{} + second;
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// y[m0 : m0 + MT, n] for one weight row n
template <class Path, int BITS, int MT>
void q8_row(const Q8& a, int64_t n, int64_t m0) {
  const int64_t blocks = a.K / BLOCK, bytes = BLOCK * BITS / 8;
  const uint8_t* c = a.codes + n * blocks * bytes;
  const float* dm = a.dm + n * blocks * 2;
  f32x16 acc[MT] = {};
  for (int64_t b = 0; b < blocks; b += 2) {
    const bool second = b + 1 < blocks;
    const auto w = Path::template prepare<BITS>(c + b * bytes, second);
    const f32x16 d = spread(dm[2 * b], second ? dm[2 * b + 2] : 0);
    for (int i = 0; i < MT; i++) {  // an odd last block reads the next block's x (padded): its d and m are 0
      const int64_t at = (m0 + i) * blocks + b;
      const i32x16 lanes = Path::dot(w, a.xq + at * BLOCK, BITS == 8 ? a.x128 + 8 * at : nullptr);
      acc[i] = Path::fma(__builtin_convertvector(lanes, f32x16), d * load16(a.xd + 8 * at), acc[i]);
    }
  }
  f32x16 offset[MT] = {};  // Q4_1: the sum of m * xdt over the blocks, 16 at a time (Q8_0: w = q * d, no offset)
  for (int64_t b = 0; BITS == 4 && b < blocks; b += 16) {
    float pairs[32] = {};  // 16 blocks' d, m (zero past the row's end)
    std::memcpy(pairs, dm + 2 * b, sizeof(float) * 2 * std::min<int64_t>(16, blocks - b));
    const f32x16 m = __builtin_shufflevector(load16(pairs), load16(pairs + 16), 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21,
                                             23, 25, 27, 29, 31);
    for (int i = 0; i < MT; i++) offset[i] = Path::fma(m, load16(a.xdt + (m0 + i) * a.S + b), offset[i]);
  }
  for (int i = 0; i < MT; i++) a.y[(m0 + i) * a.N + n] = sum16(acc[i]) + sum16(offset[i]);
}

template <class Path, int BITS>
void q8_rows(const Q8& a, int64_t M, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; n++) {
    int64_t m = 0;
    for (; m + Q8_TILE <= M; m += Q8_TILE) q8_row<Path, BITS, Q8_TILE>(a, n, m);
    switch (M - m) {
      case 3: q8_row<Path, BITS, 3>(a, n, m); break;
      case 2: q8_row<Path, BITS, 2>(a, n, m); break;
      case 1: q8_row<Path, BITS, 1>(a, n, m); break;
    }
  }
}

// each path's rows compiled for its instructions (flatten: everything they call is inlined into them)
using Rows = void (*)(const Q8&, int64_t, int64_t, int64_t);
template <int BITS>
void q8_scalar(const Q8& a, int64_t M, int64_t begin, int64_t end) { q8_rows<Scalar, BITS>(a, M, begin, end); }
#if defined(__x86_64__)
template <int BITS>
__attribute__((target("avx2,fma"), flatten)) void q8_avx2(const Q8& a, int64_t M, int64_t begin, int64_t end) {
  q8_rows<Avx2, BITS>(a, M, begin, end);
}
template <int BITS>
__attribute__((target("avx2,fma,avxvnni"), flatten)) void q8_avx_vnni(const Q8& a, int64_t M, int64_t begin,
                                                                       int64_t end) {
  q8_rows<AvxVnni, BITS>(a, M, begin, end);
}
template <int BITS>
__attribute__((target(AVX512), flatten)) void q8_avx512_vnni(const Q8& a, int64_t M, int64_t begin, int64_t end) {
  q8_rows<Avx512Vnni, BITS>(a, M, begin, end);
}
#endif

// the paths, by the number medusa::linear_q8 takes (-1: the fastest this CPU runs)
struct Q8Path {
  const char* name;
  bool (*supported)();
  Rows q4, q8;
};
const Q8Path Q8_PATHS[] = {
    {"scalar", [] { return true; }, q8_scalar<4>, q8_scalar<8>},
#if defined(__x86_64__)
    {"avx2", [] { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }, q8_avx2<4>, q8_avx2<8>},
    {"avx_vnni", [] { return __builtin_cpu_supports("avxvnni") && __builtin_cpu_supports("avx2") &&
                             __builtin_cpu_supports("fma"); }, q8_avx_vnni<4>, q8_avx_vnni<8>},
    {"avx512_vnni", [] { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                                __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx2") &&
                                __builtin_cpu_supports("fma"); }, q8_avx512_vnni<4>, q8_avx512_vnni<8>},
#endif
};
constexpr int64_t Q8_PATH_COUNT = sizeof(Q8_PATHS) / sizeof(Q8_PATHS[0]);

// the names of the paths this CPU runs, the fastest last; a path's number is its index in q8_path_names
std::vector<std::string> q8_path_names() {
  std::vector<std::string> names;
  for (const Q8Path& path : Q8_PATHS) names.push_back(path.supported() ? path.name : "");
  return names;
}

// per block of 32 values: q = round(x / d), d = amax / 127 (|q| <= 127), and what the paths read beside q
void quantize(const float* x, int64_t blocks, int64_t per_row, int64_t stride, int8_t* q, float* d, float* dt,
              int32_t* x128) {
  for (int64_t r = 0; r < blocks; r++, x += BLOCK, q += BLOCK, d += 8, x128 += 8) {
    float amax = 0;
    for (int j = 0; j < BLOCK; j++) amax = std::max(amax, std::fabs(x[j]));
    const float scale = amax / 127, inverse = scale != 0 ? 1 / scale : 0;
    int32_t sum = 0;
    for (int j = 0; j < BLOCK; j++) {
      q[j] = int8_t(std::max(-127.f, std::min(127.f, std::nearbyint(x[j] * inverse))));
      sum += q[j];
      x128[j / 4] = (j % 4 ? x128[j / 4] : 0) + 128 * q[j];
    }
    std::fill(d, d + 8, scale);
    dt[r / per_row * stride + r % per_row] = scale * float(sum);
  }
}

at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& dm, int64_t bits, int64_t path) {
  const int64_t N = codes.size(0), K = codes.size(1) * 8 / bits;
  TORCH_CHECK((bits == 4 || bits == 8) && codes.dim() == 2 && codes.scalar_type() == at::kByte && K % BLOCK == 0,
              "medusa::linear_q8: bits 4 or 8, uint8 codes [N, K * bits / 8], K a multiple of 32");
  TORCH_CHECK(dm.scalar_type() == at::kFloat && dm.numel() == N * (K / BLOCK) * 2,
              "medusa::linear_q8: float32 dm [N, K / 32, 2]");
  if (path < 0)
    for (int64_t p = 0; p < Q8_PATH_COUNT; p++) path = Q8_PATHS[p].supported() ? p : path;
  TORCH_CHECK(0 <= path && path < Q8_PATH_COUNT && Q8_PATHS[path].supported(), "medusa::linear_q8: path ", path,
              " does not run on this CPU");
  const at::Tensor xc = check_x(x, K, "medusa::linear_q8"), cc = codes.contiguous(), dmc = dm.contiguous();
  const int64_t M = xc.size(0), blocks = M * (K / BLOCK);
  std::vector<int8_t> xq(M * K + BLOCK);  // each one block longer: an odd last block is read as a pair
  const int64_t S = (K / BLOCK + 15) / 16 * 16;
  std::vector<float> xd(8 * blocks + 8), xdt(M * S);
  std::vector<int32_t> x128(8 * blocks + 8);
  quantize(xc.data_ptr<float>(), blocks, K / BLOCK, S, xq.data(), xd.data(), xdt.data(), x128.data());
  at::Tensor y = at::empty({M, N}, xc.options());
  const Q8 a{xq.data(), xd.data(), xdt.data(), x128.data(), cc.data_ptr<uint8_t>(), dmc.data_ptr<float>(),
             y.data_ptr<float>(), K, N, S};
  const Rows rows = bits == 4 ? Q8_PATHS[path].q4 : Q8_PATHS[path].q8;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) { rows(a, M, begin, end); });
  return y;
}

}  // namespace

TORCH_LIBRARY(medusa, m) {
  m.def("linear(Tensor x, Tensor w) -> Tensor");
  m.def("linear_blocks(Tensor x, Tensor codes, Tensor dm, int bits) -> Tensor");
  m.def("linear_q8(Tensor x, Tensor codes, Tensor dm, int bits, int path) -> Tensor");
  m.def("q8_path_names() -> str[]", &q8_path_names);
}

TORCH_LIBRARY_IMPL(medusa, CPU, m) {
  m.impl("linear", &linear);
  m.impl("linear_blocks", &linear_blocks);
  m.impl("linear_q8", &linear_q8);
}
