// medusa::linear(x, w) = x @ w.T in float32 on the CPU, for the few rows of a MEDUSA step (1-128 tokens).
//
// Two properties stock kernels lack:
//  - each weight row is read from memory once for every tile of x's rows, and the next tile's weight rows are
//    prefetched while this one computes: a pass over 2-8 tokens costs little more than one over 1 token;
//  - batch invariance: every output element sums its products in the same order whatever the number of rows,
//    so a token's linear layers give it bitwise the same values in a tree pass as in a one-token pass.
//
// medusa::linear_blocks computes the same for weights that are exactly GGUF Q4_1 or Q8_0 blocks (a model
// dequantized from such a file, as the embedded default is): per block of 32 weights w = code * d + m, with 4-bit
// codes (Q4_1) or 8-bit ones (Q8_0's q + 128, m = -128 d), d and m float16. code * d is exact in float32, so a
// block decodes to bitwise the float32 weight. Over up to 8 tokens (a MEDUSA step) the weights are decoded in
// registers and multiplied at once; over more, each tile's weight rows are decoded into a buffer that the same
// float32 tile then reads. Both sum every product in medusa::linear's order: the output is bitwise its, from 0.75
// (Q4_1) or 1.25 (Q8_0) bytes a weight instead of 4.
//
// The arithmetic is simd.h's 16-lane vectors: every instruction-set variant (AVX-512, AVX2, baseline) gives the
// same bits; only the tiles differ, sized for each one's registers.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using namespace simd;

constexpr int64_t LANES = 16;
constexpr int64_t TILE = 4;  // weight rows a task
constexpr int64_t BLOCK = 32;  // weights per GGUF block
// accumulators a tile keeps in registers (native vectors), and the tile of medusa::linear: TX rows of x by TW of w
#if SIMD_W == 16
constexpr int ACCUMULATORS = 16, TX = 4, TW = 4;
#elif SIMD_W == 8
constexpr int ACCUMULATORS = 12, TX = 3, TW = 2;
#else
constexpr int ACCUMULATORS = 8, TX = 2, TW = 1;
#endif
// up to here blocks are decoded in registers, for all the tokens at once (more rows than the accumulators hold would
// decode every block twice: the decoded buffer's float32 tiles cost less)
constexpr int DECODING_ROWS = std::min(8, ACCUMULATORS / P);

// acc[i][j] += x rows' 16 floats at k times w rows', part by part (both rows padded: whole vectors)
template <int MB, int NB, bool PREFETCH>
inline void step(F16 (&acc)[MB][NB], const float* x, int64_t xrow, const float* w, int64_t wrow, const float* next) {
  for (int p = 0; p < P; p++) {
    V wv[NB];
    for (int j = 0; j < NB; j++) wv[j] = load(w + j * wrow + p * W);
    for (int i = 0; i < MB; i++) {
      const V xv = load(x + i * xrow + p * W);
      for (int j = 0; j < NB; j++) acc[i][j].p[p] = fma(xv, wv[j], acc[i][j].p[p]);
    }
  }
  if (PREFETCH)
    for (int j = 0; j < NB; j++) __builtin_prefetch(next + j * wrow, 0, 2);
}

// y[m0:m0+MB, n0:n0+NB] for x [M, K], y [M, N] and w the NB weight rows [NB, K]; `next` is the weight rows to
// prefetch (PREFETCH: the weights come from memory, not from a decoded buffer)
template <int MB, int NB, bool PREFETCH>
void tile(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0,
          const float* next) {
  F16 acc[MB][NB] = {};
  int64_t k = 0;
  for (; k + LANES <= K; k += LANES) step<MB, NB, PREFETCH>(acc, x + m0 * K + k, K, w + k, K, next + k);
  if (k < K) {  // the rows' tails, zero-padded
    float xt[MB][LANES] = {}, wt[NB][LANES] = {};
    for (int i = 0; i < MB; i++) std::memcpy(xt[i], x + (m0 + i) * K + k, sizeof(float) * (K - k));
    for (int j = 0; j < NB; j++) std::memcpy(wt[j], w + j * K + k, sizeof(float) * (K - k));
    step<MB, NB, false>(acc, xt[0], LANES, wt[0], LANES, nullptr);
  }
  for (int i = 0; i < MB; i++)
    for (int j = 0; j < NB; j++) y[(m0 + i) * N + n0 + j] = sum(acc[i][j]);
}

template <int NB, bool PREFETCH>
FMA_CLONES void all_rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
                         const float* next) {
  int64_t m = 0;
  for (; m + TX <= M; m += TX) tile<TX, NB, PREFETCH>(x, w, y, K, N, m, n0, next);
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

// part p (W weights) of a block's first and second 16 weights: codes [32] (8 bits) or [16] (4 bits, byte i holding
// weight i in its low nibble and i + 16 in its high one); code * d is exact, so the fused form rounds as w does
template <int BITS>
inline void decode(const uint8_t* codes, int p, float d, float m, V& first, V& second) {
  const I a = widen(codes + p * W), b = BITS == 8 ? widen(codes + 16 + p * W) : a >> 4;
  first = fma(to_float(BITS == 8 ? a : a & 15), splat(d), splat(m));
  second = fma(to_float(b), splat(d), splat(m));
}

// codes [N, K * BITS / 8] (GGUF's bytes, block after block); dm [N, K / 32, 2]: each block's d and m.
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
      for (int p = 0; p < P; p++) {
        V first, second;
        decode<BITS>(c, p, s[0], s[1], first, second);
        store(out + p * W, first);
        store(out + LANES + p * W, second);
      }
    }
    return buffer;
  }
};

// y[0:MB, n0:n0+NB] for MB <= DECODING_ROWS tokens, the weight rows decoded in registers as they are multiplied: a
// buffer written and read back costs more than the products over so few tokens. Each accumulator sums the same
// products in the same order as `tile` does over a decoded buffer (per block, weights 0-15, then 16-31): the same bits.
template <int MB, int NB, int BITS>
void tile_decoding(const float* x, int64_t xrow, const Blocks<BITS>& w, float* y, int64_t N, int64_t n0) {
  constexpr int64_t BYTES = Blocks<BITS>::BYTES;
  const int64_t blocks = w.K / BLOCK;
  F16 acc[MB][NB] = {};
  for (int64_t b = 0; b < blocks; b++) {
    for (int j = 0; j < NB; j++) {
      const uint8_t* c = w.codes + ((n0 + j) * blocks + b) * BYTES;
      const float* s = w.dm + ((n0 + j) * blocks + b) * 2;
      if ((b * BYTES) % 64 == 0) __builtin_prefetch(c + TILE * blocks * BYTES, 0, 2);  // the next tile's row j
      if ((b * 8) % 64 == 0) __builtin_prefetch(s + TILE * blocks * 2, 0, 2);
      for (int p = 0; p < P; p++) {
        V first, second;
        decode<BITS>(c, p, s[0], s[1], first, second);
        for (int i = 0; i < MB; i++) {
          const float* xb = x + i * xrow + b * BLOCK + p * W;
          acc[i][j].p[p] = fma(load(xb), first, acc[i][j].p[p]);
          acc[i][j].p[p] = fma(load(xb + LANES), second, acc[i][j].p[p]);
        }
      }
    }
  }
  for (int i = 0; i < MB; i++)
    for (int j = 0; j < NB; j++) y[i * N + n0 + j] = sum(acc[i][j]);
}

// the weight rows [n0, n0 + TILE), NB at a time: MB x NB accumulators fit the registers
template <int MB, int BITS>
FMA_CLONES void rows_decoding(const float* x, int64_t xrow, const Blocks<BITS>& w, float* y, int64_t N, int64_t n0) {
  constexpr int NB = std::max(1, std::min<int>(TILE, ACCUMULATORS / (MB * P)));
  const int64_t end = std::min(n0 + TILE, N);
  int64_t n = n0;
  for (; n + NB <= end; n += NB) tile_decoding<MB, NB, BITS>(x, xrow, w, y, N, n);
  for (; n < end; n++) tile_decoding<MB, 1, BITS>(x, xrow, w, y, N, n);
}

// rows_decoding for M <= MB rows of x
template <int BITS, int MB = DECODING_ROWS>
void rows_decoding_upto(int64_t M, const float* x, int64_t xrow, const Blocks<BITS>& w, float* y, int64_t N,
                        int64_t n0) {
  if constexpr (MB > 1) {
    if (M < MB) return rows_decoding_upto<BITS, MB - 1>(M, x, xrow, w, y, N, n0);
  }
  rows_decoding<MB, BITS>(x, xrow, w, y, N, n0);
}

template <int BITS>
at::Tensor run_decoding(const at::Tensor& x, const Blocks<BITS>& weights, int64_t N) {
  const int64_t M = x.size(0), K = weights.K;
  at::Tensor y = x.new_empty({M, N});
  const float* X = x.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, (N + TILE - 1) / TILE, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) rows_decoding_upto<BITS>(M, X, K, weights, Y, N, t * TILE);
  });
  return y;
}

template <typename Weights>
at::Tensor run(const at::Tensor& x, const Weights& weights, int64_t N) {
  const int64_t M = x.size(0), K = weights.K;
  at::Tensor y = x.new_empty({M, N});
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
        for (int64_t j = 0; j < TILE; j += TW)
          all_rows<TW, Weights::in_place>(X, w + j * K, Y, M, K, N, n0 + j,
                                          Weights::in_place ? w + (next - n0 + j) * K : nullptr);
      } else {
        for (int64_t j = 0; j < rows; j++) all_rows<1, false>(X, w + j * K, Y, M, K, N, n0 + j, nullptr);
      }
    }
  });
  return y;
}

// ---------------------------------------------------------------------------------------------------------------
// medusa::linear_gguf(x, blocks, type) is medusa::linear over the weights a GGUF file's blocks of `type` hold, read as
// the file stores them (blocks [N, bytes a row], ggml's type numbers): each tile's rows are decoded into a buffer
// that the float32 tile then reads. A block decodes to bitwise the float32 weights the `gguf` package's dequantize
// gives (the same operations in the same order, each product exact where it is there), so the output is bitwise
// medusa::linear's over those weights.

enum GgmlType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

// weights and bytes a block of each type
template <int64_t TYPE>
constexpr int64_t WEIGHTS = TYPE >= Q4_K ? 256 : 32;
template <int64_t TYPE>
constexpr int64_t BYTES = TYPE == Q4_0 ? 18 : TYPE == Q4_1 ? 20 : TYPE == Q5_0 ? 22 : TYPE == Q5_1 ? 24 :
                          TYPE == Q8_0 ? 34 : TYPE == Q4_K ? 144 : TYPE == Q5_K ? 176 : 210;

// one block at b to WEIGHTS<TYPE> floats; 32-weight types keep weight j in byte j's low nibble and j + 16 in its high
template <int64_t TYPE>
void decode_block(const uint8_t* b, float* out) {
  if constexpr (TYPE == Q4_0 || TYPE == Q5_0) {
    const float d = f16_at(b);
    const uint8_t* qs = b + (TYPE == Q5_0 ? 6 : 2);
    uint32_t qh = 0;
    if (TYPE == Q5_0) std::memcpy(&qh, b + 2, 4);
    for (int j = 0; j < 32; j++) {
      int q = (j < 16 ? qs[j] & 15 : qs[j - 16] >> 4) | (TYPE == Q5_0 ? ((qh >> j) & 1) << 4 : 0);
      out[j] = d * float(q - (TYPE == Q5_0 ? 16 : 8));
    }
  } else if constexpr (TYPE == Q4_1 || TYPE == Q5_1) {
    const float d = f16_at(b), m = f16_at(b + 2);
    const uint8_t* qs = b + (TYPE == Q5_1 ? 8 : 4);
    uint32_t qh = 0;
    if (TYPE == Q5_1) std::memcpy(&qh, b + 4, 4);
    for (int j = 0; j < 32; j++) {
      int q = (j < 16 ? qs[j] & 15 : qs[j - 16] >> 4) | (TYPE == Q5_1 ? ((qh >> j) & 1) << 4 : 0);
      out[j] = d * float(q) + m;
    }
  } else if constexpr (TYPE == Q8_0) {
    const float d = f16_at(b);
    for (int j = 0; j < 32; j++) out[j] = d * float(int8_t(b[2 + j]));
  } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
    // sub-block s (32 weights): chunk s / 2 of 32 code bytes, low nibbles for even s, high for odd; Q5_K's fifth bit
    // of weight j is bit s of qh[j]
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t *qh = b + 16, *qs = b + (TYPE == Q5_K ? 48 : 16);
    uint8_t scales[16];  // sc 0-7, m 0-7
    scales_mins(b + 4, scales);
    for (int s = 0; s < 8; s++) {
      const float ds = d * float(scales[s]), ms = dmin * float(scales[8 + s]);
      for (int j = 0; j < 32; j++) {
        int q = (qs[s / 2 * 32 + j] >> (4 * (s % 2))) & 15;
        if (TYPE == Q5_K) q |= ((qh[j] >> s) & 1) << 4;
        out[32 * s + j] = ds * float(q) - ms;
      }
    }
  } else {  // Q6_K: group g (32 weights) of half h = g / 4, r = g % 4: low 4 bits from ql byte
    // h * 64 + (r % 2) * 32 + j (nibble r / 2), high 2 from qh byte h * 32 + j (bits 2r, 2r + 1); a scale per 16
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16_at(b + 208);
    for (int g = 0; g < 8; g++) {
      const int h = g / 4, r = g % 4;
      for (int j = 0; j < 32; j++) {
        const int low = (ql[h * 64 + (r % 2) * 32 + j] >> (4 * (r / 2))) & 15, high = (qh[h * 32 + j] >> (2 * r)) & 3;
        const int w = 32 * g + j;
        out[w] = (d * float(scales[w / 16])) * float((low | high << 4) - 32);
      }
    }
  }
}

// A block's weights 16 at a time, in registers: part(i, p) is weights [16 i + p W, 16 i + p W + W) of the block, as
// decode_block gives them (the same operations: the same bits), the block's scales read once (the constructor).
template <int64_t TYPE>
struct Decoder;

inline I signed_bytes(I a) { return a - ((a >> 7) << 8); }  // widened bytes read as int8

template <>
struct Decoder<Q8_0> {
  const uint8_t* b;
  V d;
  explicit Decoder(const uint8_t* block) : b(block), d(splat(f16_at(block))) {}
  V part(int i, int p) const { return d * to_float(signed_bytes(widen(b + 2 + 16 * i + p * W))); }
};

// Q4_0, Q4_1, Q5_0, Q5_1: weight j's low 4 bits in byte j % 16 (low nibble for j < 16, high above), Q5's fifth bit
// j of qh
template <int64_t TYPE>
struct Decoder32 {
  static constexpr bool FIVE = TYPE == Q5_0 || TYPE == Q5_1, OFFSET = TYPE == Q4_1 || TYPE == Q5_1;
  const uint8_t* qs;
  uint32_t qh = 0;
  V d, m;
  explicit Decoder32(const uint8_t* b) : qs(b + 2 + 2 * OFFSET + 4 * FIVE), d(splat(f16_at(b))) {
    m = splat(OFFSET ? f16_at(b + 2) : 0.0f);
    if (FIVE) std::memcpy(&qh, b + 2 + 2 * OFFSET, 4);
  }
  V part(int i, int p) const {
    I q = (widen(qs + p * W) >> (4 * i)) & 15;
    if (FIVE) {
      I lanes;
      for (int l = 0; l < W; l++) lanes[l] = 16 * i + p * W + l;
      q |= ((I{} + int32_t(qh)) >> lanes & 1) << 4;
    }
    if (OFFSET) return d * to_float(q) + m;
    return d * to_float(q - (FIVE ? 16 : 8));
  }
};
template <> struct Decoder<Q4_0> : Decoder32<Q4_0> { using Decoder32::Decoder32; };
template <> struct Decoder<Q4_1> : Decoder32<Q4_1> { using Decoder32::Decoder32; };
template <> struct Decoder<Q5_0> : Decoder32<Q5_0> { using Decoder32::Decoder32; };
template <> struct Decoder<Q5_1> : Decoder32<Q5_1> { using Decoder32::Decoder32; };

// Q4_K, Q5_K: sub-block s = i / 2 from code bytes (s / 2) * 32 + (i % 2) * 16.., nibble s % 2; Q5_K's fifth bit s of
// qh[(i % 2) * 16 + ..]
template <int64_t TYPE>
struct DecoderK {
  const uint8_t *qs, *qh;
  float scaled[16];  // each sub-block's d * scale, then its dmin * min
  explicit DecoderK(const uint8_t* b) : qs(b + (TYPE == Q5_K ? 48 : 16)), qh(b + 16) {
    uint8_t scales[16];  // sc 0-7, m 0-7
    scales_mins(b + 4, scales);
    float factor[16];
    for (int l = 0; l < 8; l++) factor[l] = f16_at(b), factor[8 + l] = f16_at(b + 2);
    for (int p = 0; p < 16 / W; p++) store(scaled + p * W, to_float(widen(scales + p * W)) * load(factor + p * W));
  }
  V part(int i, int p) const {
    const int s = i / 2, at = (i % 2) * 16 + p * W;
    I q = (widen(qs + s / 2 * 32 + at) >> (4 * (s % 2))) & 15;
    if (TYPE == Q5_K) q |= ((widen(qh + at) >> s) & 1) << 4;
    return splat(scaled[s]) * to_float(q) - splat(scaled[8 + s]);
  }
};
template <> struct Decoder<Q4_K> : DecoderK<Q4_K> { using DecoderK::DecoderK; };
template <> struct Decoder<Q5_K> : DecoderK<Q5_K> { using DecoderK::DecoderK; };

// Q6_K: weights 16 i.. of group g = i / 2 (h = g / 4, r = g % 4): low bits from ql[h * 64 + (r % 2) * 32 + j], nibble
// r / 2, high from qh[h * 32 + j] bits 2r; scale i
template <>
struct Decoder<Q6_K> {
  const uint8_t *ql, *qh;
  const int8_t* scales;
  float d;
  explicit Decoder(const uint8_t* b)
      : ql(b), qh(b + 128), scales(reinterpret_cast<const int8_t*>(b + 192)), d(f16_at(b + 208)) {}
  V part(int i, int p) const {
    const int g = i / 2, h = g / 4, r = g % 4, j = (i % 2) * 16 + p * W;
    const I low = (widen(ql + h * 64 + (r % 2) * 32 + j) >> (4 * (r / 2))) & 15;
    const I high = (widen(qh + h * 32 + j) >> (2 * r)) & 3;
    return splat(d * float(scales[i])) * to_float((low | high << 4) - 32);
  }
};

// y[0:MB, n0:n0+NB] for MB <= DECODING_ROWS tokens over GGUF blocks, decoded in registers (as tile_decoding): each
// accumulator sums the products 16 weights at a time in the weights' order, as `tile` over a decoded buffer does
template <int MB, int NB, int64_t TYPE>
void gguf_tile_decoding(const float* x, int64_t xrow, const uint8_t* blocks, int64_t K, float* y, int64_t N,
                        int64_t n0) {
  constexpr int64_t WB = WEIGHTS<TYPE>, B = BYTES<TYPE>;
  const int64_t per_row = K / WB, row_bytes = per_row * B;
  F16 acc[MB][NB] = {};
  for (int64_t b = 0; b < per_row; b++) {
    for (int j = 0; j < NB; j++) {
      const uint8_t* block = blocks + (n0 + j) * row_bytes + b * B;
      for (int64_t at = 0; at < B; at += 64) __builtin_prefetch(block + TILE * row_bytes + at, 0, 2);
      const Decoder<TYPE> decoder(block);
#pragma GCC unroll 16
      for (int i = 0; i < WB / 16; i++)
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) {
          const V w = decoder.part(i, p);
          for (int m = 0; m < MB; m++)
            acc[m][j].p[p] = fma(load(x + m * xrow + b * WB + 16 * i + p * W), w, acc[m][j].p[p]);
        }
    }
  }
  for (int m = 0; m < MB; m++)
    for (int j = 0; j < NB; j++) y[m * N + n0 + j] = sum(acc[m][j]);
}

template <int MB, int64_t TYPE>
FMA_CLONES void gguf_rows_decoding(const float* x, int64_t xrow, const uint8_t* blocks, int64_t K, float* y,
                                   int64_t N, int64_t n0) {
  constexpr int NB = std::max(1, std::min<int>(TILE, ACCUMULATORS / (MB * P)));
  const int64_t end = std::min(n0 + TILE, N);
  int64_t n = n0;
  for (; n + NB <= end; n += NB) gguf_tile_decoding<MB, NB, TYPE>(x, xrow, blocks, K, y, N, n);
  for (; n < end; n++) gguf_tile_decoding<MB, 1, TYPE>(x, xrow, blocks, K, y, N, n);
}

template <int64_t TYPE, int MB = DECODING_ROWS>
void gguf_rows_decoding_upto(int64_t M, const float* x, int64_t xrow, const uint8_t* blocks, int64_t K, float* y,
                             int64_t N, int64_t n0) {
  if constexpr (MB > 1) {
    if (M < MB) return gguf_rows_decoding_upto<TYPE, MB - 1>(M, x, xrow, blocks, K, y, N, n0);
  }
  gguf_rows_decoding<MB, TYPE>(x, xrow, blocks, K, y, N, n0);
}

template <int64_t TYPE>
at::Tensor gguf_run_decoding(const at::Tensor& x, const uint8_t* blocks, int64_t K, int64_t N) {
  const int64_t M = x.size(0);
  at::Tensor y = x.new_empty({M, N});
  const float* X = x.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, (N + TILE - 1) / TILE, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) gguf_rows_decoding_upto<TYPE>(M, X, K, blocks, K, Y, N, t * TILE);
  });
  return y;
}

template <int64_t TYPE>
struct Gguf {
  const uint8_t* blocks;  // [N, K / WEIGHTS * BYTES]
  int64_t K;
  static constexpr bool in_place = false;
  const float* rows(int64_t n0, int64_t rows, int64_t next, float* buffer) const {
    const int64_t per_row = K / WEIGHTS<TYPE>, row_bytes = per_row * BYTES<TYPE>;
    for (int64_t at = 0; at < rows * row_bytes; at += 64) __builtin_prefetch(blocks + next * row_bytes + at, 0, 2);
    for (int64_t r = 0; r < rows; r++)
      for (int64_t b = 0; b < per_row; b++)
        decode_block<TYPE>(blocks + (n0 + r) * row_bytes + b * BYTES<TYPE>, buffer + r * K + b * WEIGHTS<TYPE>);
    return buffer;
  }
};

at::Tensor check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, op, ": x [M, K] with K = ", K);
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": float32 x only");
  return x.contiguous();
}

// ---------------------------------------------------------------------------------------------------------------
// medusa::linear_q8(x, codes, dm, n, path) approximates linear_blocks as llama.cpp does: each token's activations are
// quantized per block of 32 to int8 (scale amax / 127), each block's dot product with the weight codes is summed in
// integers, then scaled and accumulated in float32. The weights come repacked (kernels.q8_pack) in groups of 16 rows
// whose codes are interleaved 4 by 4: lane r of an integer dot-product instruction (VNNI's vpdpbusd: 64 products)
// sums 4 products of row r, so that 16 rows' block sums build up in one register and one 4-byte broadcast of x
// feeds 16 rows. No horizontal sums, and the unpacked codes serve up to 8 tokens: over a tree the integer
// instructions do several times the work of float32 FMAs per instruction (linear_blocks is float32 FMA-bound from one
// token).
//
// Per row and block, every path does the same float32 operations in the same order: acc = fma(sum, d * dx, acc),
// then for Q4_1 acc = fma(m, dx * sum(q), acc) (the offset term). Integer sums are exact whatever the instructions,
// so every path (scalar, AVX2, AVX-VNNI, AVX-512 VNNI: chosen at run time, or forced) gives the same bits, and a
// token's output does not depend on the tokens beside it.

constexpr int64_t ROWS = 16;  // weight rows per group: a 512-bit vector's int32 lanes
constexpr int MAX_TOKENS = 8;  // tokens per pass over a group's unpacked codes
constexpr int64_t AHEAD = 8;  // blocks prefetched ahead (2 KB of Q4_1 codes)

typedef uint8_t u8x64 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));

// Each path works on a group's 16 rows LANES at a time (its vector width) with U (4 code bytes a lane), I and F
// (a lane's int32 and float32); dot(acc, w, x4) adds to each lane the 4 products of its 4 code bytes (unsigned) with
// the 4 signed bytes of x4; DIRECT: for Q8_0's codes (q + 128) it adds q * x, else w * x (the caller then subtracts
// 128 sum(x)). fma(a, b, c) lane by lane, fused.
struct Lanes16 {
  static constexpr int LANES = 16;
  typedef u8x64 U;
  typedef i32x16 I;
  typedef f32x16 F;
  static I finish(I acc) { return acc; }  // a block's sums from what dot accumulated
};

struct Scalar : Lanes16 {
  static constexpr bool DIRECT = false;
  static F widen(const at::Half* h) {
    F f;
    for (int l = 0; l < LANES; l++) f[l] = float(h[l]);
    return f;
  }
  static I dot(I acc, U w, int32_t x4) {
    int8_t x[4];
    std::memcpy(x, &x4, 4);
    for (int l = 0; l < LANES; l++)
      for (int t = 0; t < 4; t++) acc[l] += int32_t(w[4 * l + t]) * int32_t(x[t]);
    return acc;
  }
  static F fma(F a, F b, F c) {
    for (int l = 0; l < LANES; l++) c[l] = std::fma(a[l], b[l], c[l]);
    return c;
  }
};

#if defined(__x86_64__)
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TARGET_AVX_VNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define TARGET_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

struct Lanes8 {
  static constexpr int LANES = 8;
  typedef u8x32 U;
  typedef i32x8 I;
  typedef f32x8 F;
  static I finish(I acc) { return acc; }
  TARGET_AVX2 static F fma(F a, F b, F c) { return (F)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
  TARGET_AVX2 static F widen(const at::Half* h) { return (F)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)h)); }
};

// AVX2: pairs of u8 x s8 products to int16, then to int32. Q8_0's codes (up to 255) times 127 could saturate the
// pairs: they are split as |q| and x signed as q (|q| <= 128: the pairs fit), which gives q * x directly. Q4_1's
// pairs add up in int16 over a block (16 products of at most 15 * 127 a lane: no overflow) and widen once (finish).
template <bool SIGNED>
struct Avx2 : Lanes8 {
  static constexpr bool DIRECT = SIGNED;
  TARGET_AVX2 static I dot(I acc, U w, int32_t x4) {
    __m256i a = (__m256i)w, b = _mm256_set1_epi32(x4);
    if (SIGNED) {
      a = _mm256_xor_si256(a, _mm256_set1_epi8(char(0x80)));
      b = _mm256_sign_epi8(b, a), a = _mm256_abs_epi8(a);
      acc += (I)_mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
    } else {
      acc = (I)_mm256_add_epi16((__m256i)acc, _mm256_maddubs_epi16(a, b));
    }
    // each sum in a register as it is added to: else GCC regroups the additions (they are integers), computes every
    // product of a code vector first and spills 4 tokens' sums to the stack
    asm("" : "+x"(acc));
    return acc;
  }
  TARGET_AVX2 static I finish(I acc) { return SIGNED ? acc : (I)_mm256_madd_epi16((__m256i)acc, _mm256_set1_epi16(1)); }
};

struct AvxVnni : Lanes8 {
  static constexpr bool DIRECT = false;
  TARGET_AVX_VNNI static I dot(I acc, U w, int32_t x4) {
    return (I)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)w, _mm256_set1_epi32(x4));
  }
};

struct Avx512Vnni : Lanes16 {
  static constexpr bool DIRECT = false;
  TARGET_AVX512 static I dot(I acc, U w, int32_t x4) {
    return (I)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(x4));
  }
  TARGET_AVX512 static F fma(F a, F b, F c) { return (F)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
  TARGET_AVX512 static F widen(const at::Half* h) { return (F)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)h)); }
};
#endif

struct Q8 {
  const int8_t* xq;     // [M, K] the tokens' quantized activations
  const float* xd;      // [M, K / 32] each block's scale
  const float* xdt;     // [M, K / 32] scale * the sum of the block's codes (Q4_1's offset term)
  const int32_t* x128;  // [M, K / 32] 128 * the sum of the block's codes (Q8_0's codes are q + 128)
  const uint8_t* codes; // [G, K / 32, 16 * 32 * bits / 8] (q8_pack)
  const at::Half* dm;   // [G, K / 32, 2, 16] each block's d, then m, of the group's 16 rows (GGUF's float16)
  float* y;             // [M, N]
  int64_t K, N;
};

// y[m0 : m0 + MT, 16 g : 16 g + 16] (rows past N are padding: not written), in H = 16 / LANES vectors of rows: each
// 4-byte broadcast of x feeds all H (AVX2's two halves of a group share the broadcasts)
template <class P, int BITS, int MT>
void q8_group(const Q8& a, int64_t g, int64_t m0) {
  typedef typename P::U U;
  typedef typename P::I I;
  typedef typename P::F F;
  constexpr int VECTORS = BITS == 4 ? 4 : 8;  // 64-byte code vectors a block (16 rows x 4 bytes)
  constexpr int H = ROWS / P::LANES;
  const int64_t blocks = a.K / BLOCK;
  const uint8_t* c = a.codes + g * blocks * VECTORS * 64;
  const at::Half* s = a.dm + g * blocks * 2 * ROWS;
  F acc[MT][H] = {};
  for (int64_t b = 0; b < blocks; b++, c += VECTORS * 64, s += 2 * ROWS) {
    // the codes stream from memory: over several tokens a block takes long enough that the hardware prefetcher falls
    // behind (past the last group these read beyond the codes: a prefetch never faults)
    for (int v = 0; v < VECTORS; v++) __builtin_prefetch(c + AHEAD * VECTORS * 64 + 64 * v, 0, 3);
    __builtin_prefetch(s + AHEAD * 2 * ROWS, 0, 3);
    I sums[MT][H];
    // code vector j: its bytes (Q8_0) or low nibbles (Q4_1) weights 4j .. 4j + 3 of each row, Q4_1's high nibbles
    // weights 16 + 4j .. 16 + 4j + 3. Unrolled whole, each part loading its codes again (from L1: no register holds
    // them across parts): AVX2's 16 registers then hold 4 tokens' sums for both halves, with no spill, no loop counter
#pragma GCC unroll 8
    for (int j = 0; j < VECTORS; j++)
#pragma GCC unroll 2
      for (int part = 0; part < (BITS == 4 ? 2 : 1); part++) {
        U w[H];
        for (int h = 0; h < H; h++) {
          std::memcpy(&w[h], c + 64 * j + sizeof(U) * h, sizeof(U));
          if (BITS == 4) w[h] = part ? w[h] >> 4 : w[h] & 15;
        }
        for (int i = 0; i < MT; i++) {
          int32_t x4;
          std::memcpy(&x4, a.xq + (m0 + i) * a.K + b * BLOCK + 16 * part + 4 * j, 4);
          for (int h = 0; h < H; h++) sums[i][h] = P::dot(j == 0 && part == 0 ? I{} : sums[i][h], w[h], x4);
        }
      }
    for (int h = 0; h < H; h++) {
      const F d = P::widen(s + h * P::LANES), m = P::widen(s + ROWS + h * P::LANES);
      for (int i = 0; i < MT; i++) {
        sums[i][h] = P::finish(sums[i][h]);
        const int64_t at = (m0 + i) * blocks + b;
        if (BITS == 8 && !P::DIRECT) sums[i][h] -= a.x128[at];
        acc[i][h] = P::fma(__builtin_convertvector(sums[i][h], F), d * a.xd[at], acc[i][h]);
        // xdt - 0 is xdt in every lane, one broadcast from memory (0 + xdt would be an addition: -0 + 0 is +0)
        if (BITS == 4) acc[i][h] = P::fma(m, a.xdt[at] - F{}, acc[i][h]);
      }
    }
  }
  const int64_t rows = std::max<int64_t>(0, std::min<int64_t>(ROWS, a.N - g * ROWS));
  for (int i = 0; i < MT; i++) std::memcpy(a.y + (m0 + i) * a.N + g * ROWS, acc[i], sizeof(float) * rows);
}

// the last `left` (<= MT) tokens of a group from token m, in one pass: a tree of 4 to 6 candidates then streams the
// codes once, not once for 4 tokens and again for the rest
template <class P, int BITS, int MT>
void q8_tail(const Q8& a, int64_t g, int64_t m, int64_t left) {
  if constexpr (MT > 0) {
    if (left == MT) q8_group<P, BITS, MT>(a, g, m);
    else q8_tail<P, BITS, MT - 1>(a, g, m, left);
  }
}

// every token of groups [begin, end): MAX_TOKENS at a time (8-lane paths: 4, whose two halves' sums for 8 tokens
// would not fit 16 registers), then the rest in one pass
template <class P, int BITS>
void q8_groups(const Q8& a, int64_t M, int64_t begin, int64_t end) {
  constexpr int MOST = P::LANES == 8 ? 4 : MAX_TOKENS;
  for (int64_t g = begin; g < end; g++) {
    int64_t m = 0;
    for (; m + MOST <= M; m += MOST) q8_group<P, BITS, MOST>(a, g, m);
    q8_tail<P, BITS, MOST - 1>(a, g, m, M - m);
  }
}

// each path's groups compiled for its instructions (flatten: everything they call is inlined into them)
using Groups = void (*)(const Q8&, int64_t, int64_t, int64_t);
template <int BITS>
FMA_CLONES void q8_scalar(const Q8& a, int64_t M, int64_t begin, int64_t end) {
  q8_groups<Scalar, BITS>(a, M, begin, end);
}
#if defined(__x86_64__)
template <int BITS>
TARGET_AVX2 __attribute__((flatten)) void q8_avx2(const Q8& a, int64_t M, int64_t begin, int64_t end) {
  q8_groups<Avx2<BITS == 8>, BITS>(a, M, begin, end);
}
template <int BITS>
TARGET_AVX_VNNI __attribute__((flatten)) void q8_avx_vnni(const Q8& a, int64_t M, int64_t begin, int64_t end) {
  q8_groups<AvxVnni, BITS>(a, M, begin, end);
}
template <int BITS>
TARGET_AVX512 __attribute__((flatten)) void q8_avx512_vnni(const Q8& a, int64_t M, int64_t begin, int64_t end) {
  q8_groups<Avx512Vnni, BITS>(a, M, begin, end);
}
#endif

// the paths, by the number medusa::linear_q8 takes (-1: the fastest this CPU runs)
struct Q8Path {
  const char* name;
  int width;  // the vector width (in floats) the path needs this build to have been made for
  bool (*runs)();
  Groups q4, q8;
  bool supported() const { return width <= W && runs(); }
};
const Q8Path Q8_PATHS[] = {
    {"scalar", 4, [] { return true; }, q8_scalar<4>, q8_scalar<8>},
#if defined(__x86_64__)
    {"avx2", 8, [] { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c"); }, q8_avx2<4>, q8_avx2<8>},
    {"avx_vnni", 8, [] { return __builtin_cpu_supports("avxvnni") && __builtin_cpu_supports("avx2") &&
                             __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"); }, q8_avx_vnni<4>, q8_avx_vnni<8>},
    {"avx512_vnni", 16, [] { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                                __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx2") &&
                                __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"); }, q8_avx512_vnni<4>, q8_avx512_vnni<8>},
#endif
};
constexpr int64_t Q8_PATH_COUNT = sizeof(Q8_PATHS) / sizeof(Q8_PATHS[0]);

// per block of 32 values: q = round(x / d), d = amax / 127 (|q| <= 127), and the sums the paths read beside q. A
// block's scale is a long chain (a max across lanes, two divisions) that the rounding waits for, so the maxima of a
// chunk of blocks come first, side by side, then their scales W at a time, then their codes. This runs on one core
// while the other waits for the linear.
FMA_CLONES void quantize(const float* x, int64_t blocks, int8_t* q, float* d, float* dt, int32_t* x128) {
  constexpr int64_t CHUNK = 64;  // a multiple of every W
  float scale[CHUNK] = {}, inverse[CHUNK];
  for (int64_t r0 = 0; r0 < blocks; r0 += CHUNK) {
    const int64_t count = std::min(CHUNK, blocks - r0);
    for (int64_t r = 0; r < count; r++)
      scale[r] = lane_max(max(abs(load16(x + (r0 + r) * BLOCK)), abs(load16(x + (r0 + r) * BLOCK + 16))));
    for (int64_t r = 0; r < count; r += W) {
      const V s = load(scale + r) / 127;
      store(scale + r, s), store(inverse + r, s != 0 ? 1 / s : V{});
    }
    for (int64_t r = r0; r < r0 + count; r++) {
      I sums{};
      for (int h = 0; h < 2; h++) {
        const F16 values = load16(x + r * BLOCK + 16 * h);
        I n[P];
        for (int i = 0; i < P; i++) {
          V v = values.p[i] * inverse[r - r0];
          v = v < 127.f ? v : 127.f;  // std::min(127, v), then std::max(-127, v): NaN as they take it
          v = -127.f < v ? v : -127.f;
          n[i] = round_to_int(v);
          sums += n[i];
        }
        store_bytes(q + r * BLOCK + 16 * h, n);
      }
      int32_t sum = 0;
      for (int l = 0; l < W; l++) sum += sums[l];
      d[r] = scale[r - r0], dt[r] = d[r] * float(sum), x128[r] = 128 * sum;
    }
  }
}

}  // namespace

namespace medusa {

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

int64_t gguf_block_weights(int64_t type) {
  switch (type) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: return 32;
    case Q4_K: case Q5_K: case Q6_K: return 256;
  }
  return 0;
}

int64_t gguf_block_bytes(int64_t type) {
  switch (type) {
    case Q4_0: return BYTES<Q4_0>;
    case Q4_1: return BYTES<Q4_1>;
    case Q5_0: return BYTES<Q5_0>;
    case Q5_1: return BYTES<Q5_1>;
    case Q8_0: return BYTES<Q8_0>;
    case Q4_K: return BYTES<Q4_K>;
    case Q5_K: return BYTES<Q5_K>;
    case Q6_K: return BYTES<Q6_K>;
  }
  return 0;
}

// the weights a row of `blocks` holds, checked to be whole blocks of a type these kernels read
int64_t gguf_row_weights(const at::Tensor& blocks, int64_t type, const char* op) {
  const int64_t weights = gguf_block_weights(type), bytes = gguf_block_bytes(type);
  TORCH_CHECK(weights > 0, op, ": GGUF type ", type, " is not one it reads");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.size(1) % bytes == 0, op,
              ": uint8 blocks [N, whole blocks of ", bytes, " bytes]");
  return blocks.size(1) / bytes * weights;
}

template <int64_t TYPE>
void dequantize_rows(const uint8_t* blocks, float* out, int64_t N, int64_t K) {
  const int64_t per_row = K / WEIGHTS<TYPE>;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n++)
      for (int64_t b = 0; b < per_row; b++)
        decode_block<TYPE>(blocks + (n * per_row + b) * BYTES<TYPE>, out + n * K + b * WEIGHTS<TYPE>);
  });
}

at::Tensor dequantize_gguf(const at::Tensor& blocks, int64_t type) {
  const int64_t K = gguf_row_weights(blocks, type, "medusa::dequantize_gguf"), N = blocks.size(0);
  const at::Tensor bc = blocks.contiguous();
  at::Tensor out = bc.new_empty({N, K}, bc.options().dtype(at::kFloat));
  const uint8_t* data = bc.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  switch (type) {
    case Q4_0: dequantize_rows<Q4_0>(data, o, N, K); break;
    case Q4_1: dequantize_rows<Q4_1>(data, o, N, K); break;
    case Q5_0: dequantize_rows<Q5_0>(data, o, N, K); break;
    case Q5_1: dequantize_rows<Q5_1>(data, o, N, K); break;
    case Q8_0: dequantize_rows<Q8_0>(data, o, N, K); break;
    case Q4_K: dequantize_rows<Q4_K>(data, o, N, K); break;
    case Q5_K: dequantize_rows<Q5_K>(data, o, N, K); break;
    default: dequantize_rows<Q6_K>(data, o, N, K);
  }
  return out;
}

at::Tensor linear_gguf(const at::Tensor& x, const at::Tensor& blocks, int64_t type) {
  const int64_t K = gguf_row_weights(blocks, type, "medusa::linear_gguf"), N = blocks.size(0);
  at::Tensor xc = check_x(x, K, "medusa::linear_gguf"), bc = blocks.contiguous();
  const uint8_t* data = bc.data_ptr<uint8_t>();
  // up to DECODING_ROWS tokens the blocks are decoded in registers, above into a buffer (as linear_blocks)
  auto go = [&](auto type_constant) {
    constexpr int64_t TYPE = decltype(type_constant)::value;
    return 0 < xc.size(0) && xc.size(0) <= DECODING_ROWS ? gguf_run_decoding<TYPE>(xc, data, K, N)
                                                          : run(xc, Gguf<TYPE>{data, K}, N);
  };
  switch (type) {
    case Q4_0: return go(std::integral_constant<int64_t, Q4_0>{});
    case Q4_1: return go(std::integral_constant<int64_t, Q4_1>{});
    case Q5_0: return go(std::integral_constant<int64_t, Q5_0>{});
    case Q5_1: return go(std::integral_constant<int64_t, Q5_1>{});
    case Q8_0: return go(std::integral_constant<int64_t, Q8_0>{});
    case Q4_K: return go(std::integral_constant<int64_t, Q4_K>{});
    case Q5_K: return go(std::integral_constant<int64_t, Q5_K>{});
    default: return go(std::integral_constant<int64_t, Q6_K>{});
  }
}

// the names of the paths this CPU runs within this build's instruction set, the fastest last; a path's number is
// its index in q8_path_names
std::vector<std::string> q8_path_names() {
  std::vector<std::string> names;
  for (const Q8Path& path : Q8_PATHS) names.push_back(path.supported() ? path.name : "");
  return names;
}

Q8Activations quantize_q8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % BLOCK == 0 && x.scalar_type() == at::kFloat,
              "medusa::linear_q8: float32 x [M, K], K a multiple of 32");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), blocks = M * K / BLOCK;
  Q8Activations a{M, K, std::vector<int8_t>(M * K), std::vector<float>(blocks), std::vector<float>(blocks),
                  std::vector<int32_t>(blocks)};
  quantize(xc.data_ptr<float>(), blocks, a.q.data(), a.d.data(), a.dt.data(), a.x128.data());
  return a;
}

std::vector<at::Tensor> linear_q8(const Q8Activations& x, at::TensorList codes, at::TensorList dm, at::IntArrayRef n,
                                  int64_t path) {
  TORCH_CHECK(codes.size() == dm.size() && codes.size() == n.size(), "medusa::linear_q8: as many codes, dm and n");
  if (path < 0)
    for (int64_t p = 0; p < Q8_PATH_COUNT; p++) path = Q8_PATHS[p].supported() ? p : path;
  TORCH_CHECK(0 <= path && path < Q8_PATH_COUNT && Q8_PATHS[path].supported(), "medusa::linear_q8: path ", path,
              " does not run on this CPU");
  std::vector<at::Tensor> held, ys;  // held: the contiguous codes and dm the threads read
  std::vector<Q8> args;
  std::vector<Groups> groups;
  std::vector<int64_t> first{0};  // linear i's groups are [first[i], first[i + 1]) of them all
  for (size_t i = 0; i < codes.size(); i++) {
    const int64_t G = codes[i].size(0), blocks = codes[i].dim() == 3 ? codes[i].size(1) : 0, K = blocks * BLOCK;
    const int64_t bits = codes[i].dim() == 3 ? codes[i].size(2) * 8 / (ROWS * BLOCK) : 0;
    TORCH_CHECK((bits == 4 || bits == 8) && codes[i].scalar_type() == at::kByte &&
                codes[i].size(2) == ROWS * BLOCK * bits / 8 && (n[i] + ROWS - 1) / ROWS == G,
                "medusa::linear_q8: uint8 codes [ceil(n / 16), K / 32, 16 * 32 * bits / 8], bits 4 or 8 "
                "(kernels.q8_pack)");
    TORCH_CHECK(dm[i].scalar_type() == at::kHalf && dm[i].numel() == G * blocks * 2 * ROWS,
                "medusa::linear_q8: float16 dm [ceil(n / 16), K / 32, 2, 16]");
    TORCH_CHECK(x.K == K, "medusa::linear_q8: x [M, K] with K = ", K);
    held.push_back(codes[i].contiguous()), held.push_back(dm[i].contiguous());
    ys.push_back(codes[i].new_empty({x.M, n[i]}, at::kFloat));
    args.push_back(Q8{x.q.data(), x.d.data(), x.dt.data(), x.x128.data(), held[2 * i].data_ptr<uint8_t>(),
                      held[2 * i + 1].data_ptr<at::Half>(), ys[i].data_ptr<float>(), K, n[i]});
    groups.push_back(bits == 4 ? Q8_PATHS[path].q4 : Q8_PATHS[path].q8), first.push_back(first[i] + G);
  }
  at::parallel_for(0, first.back(), 1, [&](int64_t begin, int64_t end) {
    for (size_t i = 0; i < args.size(); i++) {  // the part of [begin, end) that is linear i's
      const int64_t b = std::max(begin, first[i]), e = std::min(end, first[i + 1]);
      if (b < e) groups[i](args[i], x.M, b - first[i], e - first[i]);
    }
  });
  return ys;
}

at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& dm, int64_t n, int64_t path) {
  return linear_q8(quantize_q8(x), {codes}, {dm}, {n}, path)[0];
}

}  // namespace medusa
