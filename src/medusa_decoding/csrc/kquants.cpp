// medusa::linear_k(x, blocks, type): x [M, K] @ W.T for W a GGUF file's Q4_K or Q6_K blocks as the file holds them
// (blocks [N, bytes a row]), in llama.cpp's arithmetic for these types: each token's activations quantized per 256 to
// Q8_K (int8 codes, one float32 scale, llama.cpp's quantize_row_q8_K rounding), every product of a super-block
// summed in integers with the blocks' integer sub-block scales, then scaled once in float32 per super-block. The
// integer sums are exact whatever the instructions, and the float32 operations are the same scalar ones in the same
// order on every path (scalar, AVX2): the same bits everywhere, and a token's output does not depend on the tokens
// beside it. Over a tree the blocks' codes are unpacked once for up to 8 tokens: integer dot products do several
// times the work of float32 FMAs per instruction, so extra candidates cost little. A one-token step streams the
// weights once, so the blocks are prefetched far enough ahead (PREFETCH) to hide the memory's latency.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "simd.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using simd::f16_at;
using simd::scales_mins;

constexpr int64_t QK = 256;       // weights a super-block
constexpr int64_t TILE_ROWS = 4;  // weight rows a task
constexpr int MOST = 8;           // tokens a pass over a row's unpacked codes
constexpr int64_t PREFETCH = 16;  // super-blocks ahead a row's pass asks for (to L1): about 2 KB, DRAM's latency
constexpr int64_t Q4_K = 12, Q6_K = 14, Q4_K_BYTES = 144, Q6_K_BYTES = 210;

// x as llama.cpp's Q8_K: per 256 values codes q = min(127, round(-127 / max * x)) (max: the value of largest magnitude,
// signed; ties to even), d = 1 / (-127 / max), and the sums of each 16 and each 32 codes
struct Q8K {
  int64_t M, K;
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> d;       // [M, K / 256]
  std::vector<int16_t> sums;    // [M, K / 16]: |sum| <= 16 * 127
  std::vector<int16_t> sums32;  // [M, K / 32]: |sum| <= 32 * 127 (AVX2 multiplies them in int16 pairs)
};

int nearest_int(float v) {  // llama.cpp's: to nearest, ties to even, for |v| < 2^22
  float biased = v + 12582912.f;
  int32_t i;
  std::memcpy(&i, &biased, 4);
  return (i & 0x007fffff) - 0x00400000;
}

Q8K quantize_q8k(const float* x, int64_t M, int64_t K) {
  Q8K a{M, K, std::vector<int8_t>(M * K), std::vector<float>(M * K / QK), std::vector<int16_t>(M * K / 16),
        std::vector<int16_t>(M * K / 32)};
  for (int64_t b = 0; b < M * K / QK; b++) {
    const float* v = x + b * QK;
    float max = 0, amax = 0;
    for (int j = 0; j < QK; j++)
      if (std::fabs(v[j]) > amax) amax = std::fabs(v[j]), max = v[j];
    int8_t* q = a.q.data() + b * QK;
    if (amax == 0) {
      std::fill(q, q + QK, 0);
      std::fill(a.sums.begin() + b * 16, a.sums.begin() + b * 16 + 16, 0);
      std::fill(a.sums32.begin() + b * 8, a.sums32.begin() + b * 8 + 8, 0);
      a.d[b] = 0;
      continue;
    }
    const float iscale = -127.f / max;
    for (int j = 0; j < QK; j++) q[j] = int8_t(std::min(127, nearest_int(iscale * v[j])));
    for (int s = 0; s < 16; s++) {
      int32_t sum = 0;
      for (int j = 0; j < 16; j++) sum += q[16 * s + j];
      a.sums[b * 16 + s] = int16_t(sum);
    }
    for (int s = 0; s < 8; s++) a.sums32[b * 8 + s] = int16_t(a.sums[b * 16 + 2 * s] + a.sums[b * 16 + 2 * s + 1]);
    a.d[b] = 1 / iscale;
  }
  return a;
}

// The integer sums of a super-block for MT tokens: sum over its 32-weight groups g of dot(codes of g, x of g), each 16
// weights' products times their scale. Codes are unsigned (Q4_K: 0-15; Q6_K: 0-63, whose -32 the caller takes off
// with the sums of x). A Layout gives group g's 32 codes (`bytes`) and the scale of its weights 16 * half..
// (`scale`).
struct Scalar {
  template <int MT, class Layout>
  static void sums(const Layout& layout, const int8_t* const* x, int32_t* out) {
    for (int m = 0; m < MT; m++) out[m] = 0;
    uint8_t codes[32];
    for (int g = 0; g < 8; g++) {
      layout.bytes(g, codes);
      for (int m = 0; m < MT; m++)
        for (int h = 0; h < 2; h++) {
          int32_t dot = 0;
          for (int j = 16 * h; j < 16 * h + 16; j++) dot += int32_t(codes[j]) * int32_t(x[m][32 * g + j]);
          out[m] += layout.scale(g, h) * dot;
        }
    }
  }
};

#if defined(__x86_64__)
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
struct Avx2 {};  // the AVX2 path: q4k_block_avx2, q6k_block_avx2
#else
#define TARGET_AVX2
#endif

// Q4_K on the scalar path: group g is sub-block g: code bytes (g / 2) * 32.., low nibbles for even g, high for odd
struct Q4KLayout {
  const uint8_t* qs;
  uint8_t sc[8];
  void bytes(int g, uint8_t* codes) const {
    for (int j = 0; j < 32; j++) codes[j] = (qs[g / 2 * 32 + j] >> (4 * (g % 2))) & 15;
  }
  int32_t scale(int g, int) const { return sc[g]; }
};

// Q6_K on the scalar path: group g (h = g / 4, r = g % 4): low 4 bits from ql[h * 64 + (r % 2) * 32 + j] (nibble
// r / 2), high 2 from qh[h * 32 + j] (bits 2r); an int8 scale per 16 weights
struct Q6KLayout {
  const uint8_t *ql, *qh;
  const int8_t* scales;
  void bytes(int g, uint8_t* codes) const {
    const int h = g / 4, r = g % 4;
    for (int j = 0; j < 32; j++)
      codes[j] = ((ql[h * 64 + (r % 2) * 32 + j] >> (4 * (r / 2))) & 15) | (((qh[h * 32 + j] >> (2 * r)) & 3) << 4);
  }
  int32_t scale(int g, int half) const { return scales[2 * g + half]; }
};

#if defined(__x86_64__)
// Q4_K on AVX2 (on AVX-512 CPUs too: 512-bit vectors multiply no faster here): a super-block for MT tokens, each 32
// code bytes unpacked once (low nibbles: sub-block 2k, high: 2k + 1), their scales spread by a byte shuffle; the minima
// times the x sums in int16 pairs (madd); a token's two integers reduced in one tree. The integers are the scalar
// path's exactly, the float32 operations the same.
template <int MT>
TARGET_AVX2 inline void q4k_block_avx2(const uint8_t* block, const int8_t* const* x, const float* xd,
                                       const int16_t* const* xsums32, float* acc) {
  uint8_t scales_and_mins[16];
  scales_mins(block + 4, scales_and_mins);
  const __m256i wide = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)scales_and_mins));
  const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(wide));  // int16 sc 0-7, both lanes
  const __m128i mins = _mm256_extracti128_si256(wide, 1);
  const __m256i m4 = _mm256_set1_epi8(15);
  const uint8_t* qs = block + 16;
  __m256i sums[MT];
  for (int m = 0; m < MT; m++) sums[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int k = 0; k < 4; k++) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i*)(qs + 32 * k));
    const __m256i low = _mm256_and_si256(bytes, m4), high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), m4);
    // int16 lane e of `scales` is its bytes 2e and 2e + 1: every lane gets sub-block 2k's scale, or 2k + 1's
    const __m256i s_low = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(int16_t(((4 * k + 1) << 8) | (4 * k))));
    const __m256i s_high = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(int16_t(((4 * k + 3) << 8) | (4 * k + 2))));
    for (int m = 0; m < MT; m++) {
      const __m256i x_low = _mm256_loadu_si256((const __m256i*)(x[m] + 64 * k));
      const __m256i x_high = _mm256_loadu_si256((const __m256i*)(x[m] + 64 * k + 32));
      const __m256i p_low = _mm256_madd_epi16(_mm256_maddubs_epi16(low, x_low), s_low);
      const __m256i p_high = _mm256_madd_epi16(_mm256_maddubs_epi16(high, x_high), s_high);
      sums[m] = _mm256_add_epi32(sums[m], _mm256_add_epi32(p_low, p_high));
    }
  }
  const float d = f16_at(block), dmin = f16_at(block + 2);
  for (int m = 0; m < MT; m++) {
    const __m128i minima = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i*)xsums32[m]));
    const __m128i four = _mm_add_epi32(_mm256_castsi256_si128(sums[m]), _mm256_extracti128_si256(sums[m], 1));
    __m128i both = _mm_hadd_epi32(four, minima);
    both = _mm_hadd_epi32(both, both);  // the sum, the minima, the sum, the minima
    acc[m] = std::fma(float(_mm_cvtsi128_si32(both)), d * xd[m], acc[m]);
    acc[m] = std::fma(float(_mm_extract_epi32(both, 1)), -(dmin * xd[m]), acc[m]);
  }
}
#endif

template <int MT>
void q4k_block(const uint8_t* block, const int8_t* const* x, const float* xd, const int16_t* const* xsums32,
               float* acc) {
  Q4KLayout layout{block + 16, {}};
  uint8_t scales[16];  // sc 0-7, m 0-7
  int32_t sums[MT];
  scales_mins(block + 4, scales);
  std::memcpy(layout.sc, scales, 8);
  const uint8_t* mn = scales + 8;
  Scalar::sums<MT>(layout, x, sums);
  const float d = f16_at(block), dmin = f16_at(block + 2);
  for (int m = 0; m < MT; m++) {
    int32_t minima = 0;  // the offset term: each sub-block's min times the sum of its 32 x codes
    for (int g = 0; g < 8; g++) minima += int32_t(mn[g]) * xsums32[m][g];
    acc[m] = std::fma(float(sums[m]), d * xd[m], acc[m]);
    acc[m] = std::fma(float(minima), -(dmin * xd[m]), acc[m]);
  }
}

#if defined(__x86_64__)
// Q6_K on AVX2: a super-block for MT tokens, a half (128 weights) at a time: its 64 low-nibble bytes and 32 high-bit
// bytes unpacked once into four groups of 32 codes; each group's two int8 scales spread into int16 halves by a byte
// shuffle. The codes' -32 is taken off in the integers (each 16 x codes' sum times its scale, in int16 pairs), and a
// token's total reduced once: the scalar path's integer exactly, the float32 operation the same.
template <int MT>
TARGET_AVX2 inline void q6k_block_avx2(const uint8_t* block, const int8_t* const* x, const float* xd,
                                       const int16_t* const* xsums, float* acc) {
  const uint8_t *ql = block, *qh = block + 128;
  const __m128i scales = _mm_loadu_si128((const __m128i*)(block + 192));
  const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
  __m256i sums[MT];
  for (int m = 0; m < MT; m++) sums[m] = _mm256_setzero_si256();
#pragma GCC unroll 2
  for (int h = 0; h < 2; h++) {
    const __m256i low0 = _mm256_loadu_si256((const __m256i*)(ql + 64 * h));
    const __m256i low1 = _mm256_loadu_si256((const __m256i*)(ql + 64 * h + 32));
    const __m256i high = _mm256_loadu_si256((const __m256i*)(qh + 32 * h));
    const __m256i nibbles[4] = {_mm256_and_si256(low0, m4), _mm256_and_si256(low1, m4),
                                _mm256_and_si256(_mm256_srli_epi16(low0, 4), m4),
                                _mm256_and_si256(_mm256_srli_epi16(low1, 4), m4)};
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) {  // group g = 4h + r: weights 32g.., scales 2g (the first 16) and 2g + 1
      const int g = 4 * h + r;
      const __m256i two = _mm256_and_si256(_mm256_srli_epi16(high, 2 * r), m2);
      const __m256i codes = _mm256_or_si256(nibbles[r], _mm256_slli_epi16(two, 4));
      const __m128i spread = _mm_shuffle_epi8(scales, _mm_set_epi64x(0x0101010101010101LL * (2 * g + 1),
                                                                     0x0101010101010101LL * (2 * g)));
      const __m256i scale = _mm256_cvtepi8_epi16(spread);
      for (int m = 0; m < MT; m++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i*)(x[m] + 32 * g));
        sums[m] = _mm256_add_epi32(sums[m], _mm256_madd_epi16(_mm256_maddubs_epi16(codes, xv), scale));
      }
    }
  }
  const __m256i scales16 = _mm256_cvtepi8_epi16(scales);
  const float d = f16_at(block + 208);
  for (int m = 0; m < MT; m++) {
    const __m256i offset = _mm256_madd_epi16(scales16, _mm256_loadu_si256((const __m256i*)xsums[m]));
    const __m256i total = _mm256_sub_epi32(sums[m], _mm256_slli_epi32(offset, 5));
    __m128i four = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    four = _mm_add_epi32(four, _mm_shuffle_epi32(four, 0x4E));
    four = _mm_add_epi32(four, _mm_shuffle_epi32(four, 0xB1));
    acc[m] = std::fma(float(_mm_cvtsi128_si32(four)), d * xd[m], acc[m]);
  }
}
#endif

template <int MT>
void q6k_block(const uint8_t* block, const int8_t* const* x, const float* xd, const int16_t* const* xsums,
               float* acc) {
  const Q6KLayout layout{block, block + 128, reinterpret_cast<const int8_t*>(block + 192)};
  int32_t sums[MT];
  Scalar::sums<MT>(layout, x, sums);
  const float d = f16_at(block + 208);
  for (int m = 0; m < MT; m++) {
    int32_t offset = 0;  // each 16 x codes' sum times their scale: 32 of it is the codes' -32
    for (int s = 0; s < 16; s++) offset += int32_t(layout.scales[s]) * xsums[m][s];
    acc[m] = std::fma(float(sums[m] - 32 * offset), d * xd[m], acc[m]);
  }
}

template <class Path, int64_t TYPE, int MT>
void rows(const Q8K& a, const uint8_t* blocks, float* y, int64_t N, int64_t n0, int64_t n1, int64_t m0) {
  constexpr int64_t BYTES = TYPE == Q4_K ? Q4_K_BYTES : Q6_K_BYTES;
  const int64_t per_row = a.K / QK;
  for (int64_t n = n0; n < n1; n++) {
    float acc[MT] = {};
    const uint8_t* row = blocks + n * per_row * BYTES;
    for (int64_t b = 0; b < per_row; b++) {
      for (int64_t line = 0; line < BYTES; line += 64) __builtin_prefetch(row + (b + PREFETCH) * BYTES + line, 0, 3);
      const int8_t* x[MT];
      const int16_t* xsums[MT];  // per 16 (Q6_K) or 32 (Q4_K) codes
      float xd[MT];
      for (int m = 0; m < MT; m++) {
        x[m] = a.q.data() + (m0 + m) * a.K + b * QK;
        xsums[m] = TYPE == Q4_K ? a.sums32.data() + ((m0 + m) * per_row + b) * 8
                                : a.sums.data() + ((m0 + m) * per_row + b) * 16;
        xd[m] = a.d[(m0 + m) * per_row + b];
      }
#if defined(__x86_64__)
      constexpr bool avx2 = std::is_same_v<Path, Avx2>;
      if constexpr (avx2 && TYPE == Q4_K) q4k_block_avx2<MT>(row + b * BYTES, x, xd, xsums, acc);
      else if constexpr (avx2) q6k_block_avx2<MT>(row + b * BYTES, x, xd, xsums, acc);
      else
#endif
      if constexpr (TYPE == Q4_K) q4k_block<MT>(row + b * BYTES, x, xd, xsums, acc);
      else q6k_block<MT>(row + b * BYTES, x, xd, xsums, acc);
    }
    for (int m = 0; m < MT; m++) y[(m0 + m) * N + n] = acc[m];
  }
}

// tokens [m0, m0 + left) for left <= MOST, in one pass
template <class Path, int64_t TYPE, int MT = MOST>
void tail(const Q8K& a, const uint8_t* blocks, float* y, int64_t N, int64_t n0, int64_t n1, int64_t m0,
          int64_t left) {
  if constexpr (MT > 0) {
    if (left == MT) rows<Path, TYPE, MT>(a, blocks, y, N, n0, n1, m0);
    else tail<Path, TYPE, MT - 1>(a, blocks, y, N, n0, n1, m0, left);
  }
}

template <class Path, int64_t TYPE>
void all_tokens(const Q8K& a, const uint8_t* blocks, float* y, int64_t N, int64_t n0, int64_t n1) {
  int64_t m = 0;
  for (; m + MOST <= a.M; m += MOST) rows<Path, TYPE, MOST>(a, blocks, y, N, n0, n1, m);
  tail<Path, TYPE>(a, blocks, y, N, n0, n1, m, a.M - m);
}

template <int64_t TYPE>
void scalar_tokens(const Q8K& a, const uint8_t* blocks, float* y, int64_t N, int64_t n0, int64_t n1) {
  all_tokens<Scalar, TYPE>(a, blocks, y, N, n0, n1);
}
#if defined(__x86_64__)
template <int64_t TYPE>
TARGET_AVX2 __attribute__((flatten)) void avx2_tokens(const Q8K& a, const uint8_t* blocks, float* y, int64_t N,
                                                      int64_t n0, int64_t n1) {
  all_tokens<Avx2, TYPE>(a, blocks, y, N, n0, n1);
}
#endif

bool has_avx2() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

}  // namespace

namespace medusa {

at::Tensor linear_k(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t path) {
  const int64_t bytes = type == Q4_K ? Q4_K_BYTES : Q6_K_BYTES;
  TORCH_CHECK(type == Q4_K || type == Q6_K, "medusa::linear_k: GGUF type ", type, " is not Q4_K (12) or Q6_K (14)");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.size(1) % bytes == 0,
              "medusa::linear_k: uint8 blocks [N, whole blocks of ", bytes, " bytes]");
  const int64_t N = blocks.size(0), K = blocks.size(1) / bytes * QK;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kFloat,
              "medusa::linear_k: float32 x [M, K] with K = ", K);
  // 0 scalar, 1 AVX2 (-1: the fastest this CPU runs)
  path = path >= 0 ? path : has_avx2() ? 1 : 0;
  TORCH_CHECK(path == 0 || (path == 1 && has_avx2()), "medusa::linear_k: path ", path, " does not run on this CPU");
  const at::Tensor xc = x.contiguous(), bc = blocks.contiguous();
  const Q8K a = quantize_q8k(xc.data_ptr<float>(), xc.size(0), K);
  at::Tensor y = xc.new_empty({xc.size(0), N});
  const uint8_t* data = bc.data_ptr<uint8_t>();
  float* Y = y.data_ptr<float>();
  using Rows = void (*)(const Q8K&, const uint8_t*, float*, int64_t, int64_t, int64_t);
  Rows run = type == Q4_K ? scalar_tokens<Q4_K> : scalar_tokens<Q6_K>;
#if defined(__x86_64__)
  if (path == 1) run = type == Q4_K ? avx2_tokens<Q4_K> : avx2_tokens<Q6_K>;
#endif
  at::parallel_for(0, (N + TILE_ROWS - 1) / TILE_ROWS, 8, [&](int64_t begin, int64_t end) {
    run(a, data, Y, N, begin * TILE_ROWS, std::min(N, end * TILE_ROWS));
  });
  return y;
}

}  // namespace medusa
