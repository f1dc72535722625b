// The kernels' vectors. Their arithmetic is defined on 16 float lanes (F16); each instruction set holds an F16 as
// P native vectors of W lanes (AVX-512: 1 x 16, AVX2 + FMA: 2 x 8, the portable baseline: 4 x 4) and does the same
// lane operations in the same order. Sources build with -ffp-contract=off, so a multiply-add is fused only where
// `fma` says so, on every build: each variant gives the same bits, and its code stays in native registers (GCC
// splits a generic 16-lane vector on AVX2 through the stack). Horizontal sums add lane l and lane l + half, halves
// first, then quarters, eighths, pairs: one tree for every variant.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace {  // internal linkage: each variant's library keeps its own
namespace simd {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__FMA__)
#define SIMD_W 16
constexpr const char* VARIANT = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
#define SIMD_W 8
constexpr const char* VARIANT = "avx2";
#else
#define SIMD_W 4
constexpr const char* VARIANT = "baseline";
#endif
// The portable baseline on an x86 CPU with FMA: its hot loops also compile for the FMA instruction, chosen when the
// library loads (without it each lane's fma is a call into libm). fma is fma: the same bits.
#if SIMD_W == 4 && defined(__x86_64__)
#define FMA_CLONES __attribute__((target_clones("fma", "default"), flatten))
#else
#define FMA_CLONES
#endif
constexpr int W = SIMD_W;
constexpr int P = 16 / W;

typedef float V __attribute__((vector_size(4 * W)));
typedef int32_t I __attribute__((vector_size(4 * W)));

inline V splat(float x) { return V{} + x; }
inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }

inline V fma(V a, V b, V c) {  // a * b + c, rounded once
#if SIMD_W == 16
  return (V)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif SIMD_W == 8
  return (V)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__aarch64__)
  return (V)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#else
  for (int l = 0; l < W; l++) c[l] = std::fma(a[l], b[l], c[l]);
  return c;
#endif
}

// W unsigned bytes at p, as int32 lanes
inline I widen(const uint8_t* p) {
#if SIMD_W == 16
  return (I)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
#elif SIMD_W == 8
  return (I)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
#else
  I v;
  for (int l = 0; l < W; l++) v[l] = p[l];
  return v;
#endif
}

inline V to_float(I v) { return __builtin_convertvector(v, V); }

inline V abs(V a) { return (V)((I)a & 0x7fffffff); }  // the sign bit cleared, as fabs

// the float16 at p (its bits, any alignment) as float32: exact; F16C's conversion where the build has it, else the
// fields moved as load16's baseline moves them
inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t exponent = h & 0x7c00;
  uint32_t bits = ((h & 0x7fff) << 13) + (112 << 23);  // the exponent's bias 15 -> 127
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float small = float(h & 0x3ff) * 0x1p-24f;
    std::memcpy(&bits, &small, 4);
  } else if (exponent == 0x7c00) {  // infinities, NaNs
    bits += 112 << 23;
  }
  bits |= uint32_t(h & 0x8000) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// Q4_K and Q5_K's 8 sub-blocks' 6-bit scales and minima (sc[8] then m[8] in out) from their 12 bytes, 4 at a time
// (one word each): sc 0-3 are the low 6 bits of bytes 0-3, m 0-3 of bytes 4-7; sc 4-7 the low nibbles of bytes 8-11
// with the top 2 bits of bytes 0-3 above, m 4-7 their high nibbles with the top 2 bits of bytes 4-7
inline void scales_mins(const uint8_t* s, uint8_t* out) {
  uint32_t u[3], words[4];
  std::memcpy(u, s, 12);
  const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  words[0] = u[0] & low6, words[2] = u[1] & low6;
  words[1] = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);
  words[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);
  std::memcpy(out, words, 16);
}

// 16 lanes as P native vectors
struct F16 {
  V p[P];
};

inline F16 zero() { return F16{}; }

inline F16 load16(const float* x) {
  F16 a;
  for (int i = 0; i < P; i++) a.p[i] = load(x + i * W);
  return a;
}

// 16 float16 values (their bits) at x, widened to float32: exact, so every variant reads the same floats
inline F16 load16(const uint16_t* x) {
#if SIMD_W == 16
  return F16{{(V)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)x))}};
#elif SIMD_W == 8
  return F16{{(V)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)x)),
              (V)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(x + 8)))}};
#else
  F16 a;
  for (int i = 0; i < P; i++) {  // a float16's fields moved into a float32's
    I h, bits;
    for (int l = 0; l < W; l++) h[l] = x[i * W + l];
    const I exponent = h & 0x7c00, normal = ((h & 0x7fff) << 13) + (112 << 23);  // the exponent's bias 15 -> 127
    const V small = to_float(h & 0x3ff) * 0x1p-24f;  // exponent 0: zero or subnormal, mantissa * 2^-24
    std::memcpy(&bits, &small, sizeof bits);
    bits = exponent == 0 ? bits : exponent == 0x7c00 ? normal + (112 << 23) : normal;  // infinities, NaNs: 255
    bits |= (h & 0x8000) << 16;
    std::memcpy(&a.p[i], &bits, sizeof bits);
  }
  return a;
#endif
}

// a whole vector's count loads and stores directly; fewer go through a buffer (a copy of variable size)
template <typename E>  // float or float16 bits
inline F16 load16(const E* x, int64_t count) {  // lanes past count are 0
  if (count == 16) return load16(x);
  E buffer[16] = {};
  std::memcpy(buffer, x, sizeof(E) * count);
  return load16(buffer);
}

inline void store16(float* x, F16 a, int64_t count = 16) {
  if (count == 16) {
    for (int i = 0; i < P; i++) store(x + i * W, a.p[i]);
    return;
  }
  float buffer[16];
  for (int i = 0; i < P; i++) std::memcpy(buffer + i * W, &a.p[i], sizeof(V));
  std::memcpy(x, buffer, sizeof(float) * count);
}

inline F16 fma(F16 a, F16 b, F16 c) {
  for (int i = 0; i < P; i++) c.p[i] = fma(a.p[i], b.p[i], c.p[i]);
  return c;
}

inline F16 fma(float a, F16 b, F16 c) {
  const V s = splat(a);
  for (int i = 0; i < P; i++) c.p[i] = fma(s, b.p[i], c.p[i]);
  return c;
}

inline F16 operator+(F16 a, F16 b) {
  for (int i = 0; i < P; i++) a.p[i] += b.p[i];
  return a;
}

inline F16 splat16(float x) {
  F16 a;
  for (int i = 0; i < P; i++) a.p[i] = splat(x);
  return a;
}

inline F16 operator*(F16 a, F16 b) {
  for (int i = 0; i < P; i++) a.p[i] *= b.p[i];
  return a;
}

inline F16 operator-(F16 a, float s) {
  for (int i = 0; i < P; i++) a.p[i] -= s;
  return a;
}

inline F16 operator*(F16 a, float s) {
  for (int i = 0; i < P; i++) a.p[i] *= s;
  return a;
}

inline F16 max(F16 a, F16 b) {  // a > b ? a : b, lane by lane
  for (int i = 0; i < P; i++) a.p[i] = a.p[i] > b.p[i] ? a.p[i] : b.p[i];
  return a;
}

inline F16 abs(F16 a) {
  for (int i = 0; i < P; i++) a.p[i] = abs(a.p[i]);
  return a;
}

// the largest lane: lane l against lane l + 8, then l + 4, l + 2, l + 1 (4 steps deep, not a chain of 16), each
// step b > a ? b : a, which is x86's max(b, a) (NaNs included)
inline float lane_max(F16 a) {
#if SIMD_W >= 8
#if SIMD_W == 16
  const __m256 m = _mm256_max_ps(_mm512_extractf32x8_ps((__m512)a.p[0], 1), _mm512_castps512_ps256((__m512)a.p[0]));
#else
  const __m256 m = _mm256_max_ps((__m256)a.p[1], (__m256)a.p[0]);
#endif
  __m128 h = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
  h = _mm_max_ps(_mm_movehl_ps(h, h), h);
  return _mm_cvtss_f32(_mm_max_ss(_mm_movehdup_ps(h), h));
#else
  float s[16];
  store16(s, a);
  auto fold = [&](int half) {
    for (int l = 0; l < half; l++) s[l] = s[l + half] > s[l] ? s[l + half] : s[l];
  };
  fold(8), fold(4), fold(2), fold(1);
  return s[0];
#endif
}

// each lane to the nearest integer, ties to even (nearbyint; |a| < 2^22)
inline I round_to_int(V a) {
#if SIMD_W == 16
  return (I)_mm512_cvtps_epi32((__m512)a);  // in the default rounding mode, as the addition below
#elif SIMD_W == 8
  return (I)_mm256_cvtps_epi32((__m256)a);
#else
  return __builtin_convertvector((a + 0x1.8p23f) - 0x1.8p23f, I);
#endif
}

// 16 int32 lanes in [-128, 127] stored as bytes
inline void store_bytes(int8_t* q, const I* v) {
#if SIMD_W == 16
  _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8((__m512i)v[0]));
#elif SIMD_W == 8  // packs interleave the two 128-bit halves: the permute puts v[0]'s words before v[1]'s
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32((__m256i)v[0], (__m256i)v[1]), 0xD8);
  _mm_storeu_si128((__m128i*)q, _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
#else
  for (int i = 0; i < P; i++)
    for (int l = 0; l < W; l++) q[i * W + l] = int8_t(v[i][l]);
#endif
}

// lanes from `count` on replaced by `fill`
inline F16 first(F16 a, int64_t count, float fill) {
  static const float lanes[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int i = 0; i < P; i++) a.p[i] = load(lanes + i * W) < float(count) ? a.p[i] : splat(fill);
  return a;
}

// the 16 lanes' sum: lane l + lane l + 8, then l + 4, l + 2, l + 1
inline float sum(F16 a) {
  float s[16];
  store16(s, a);
  for (int l = 0; l < 8; l++) s[l] += s[l + 8];
  for (int l = 0; l < 4; l++) s[l] += s[l + 4];
  return (s[0] + s[2]) + (s[1] + s[3]);
}

// e^x for x <= 0, lane by lane: Cephes' polynomial on x - n ln 2 (relative error ~1e-7; below e^-87, 2^-126 * p)
inline V exp(V x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  const V t = fma(x, splat(1.44269504088896341f), splat(0.5f));
  V n = __builtin_convertvector(__builtin_convertvector(t, I), V);
  n = n > t ? n - 1 : n;  // floor (the conversion truncates towards zero)
  x = fma(n, splat(-0.693359375f), x);
  x = fma(n, splat(2.12194440e-4f), x);
  const V z = x * x;
  V y = fma(splat(1.9875691500e-4f), x, splat(1.3981999507e-3f));
  y = fma(y, x, splat(8.3334519073e-3f));
  y = fma(y, x, splat(4.1665795894e-2f));
  y = fma(y, x, splat(1.6666665459e-1f));
  y = fma(y, x, splat(5.0000001201e-1f));
  y = fma(y, z, x) + 1.0f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;  // 2^n
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

inline F16 exp(F16 a) {
  for (int i = 0; i < P; i++) a.p[i] = exp(a.p[i]);
  return a;
}

// The sums of 16 vectors, vector j's in lane j, each by `sum`'s tree. `half(a)` folds a vector to its 8 lanes
// l + l + 8 (the first step); `sums16` takes the 16 folded vectors.
#if SIMD_W == 16
inline F16 half(F16 a) { return a; }  // folded inside sums16, two vectors a shuffle
inline F16 sums16(F16* v) {
  V w[8];
  for (int i = 0; i < 8; i++) {  // vectors 2i, 2i + 1 -> lanes 0-7, 8-15
    const V a = v[2 * i].p[0], b = v[2 * i + 1].p[0];
    w[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; i++)  // 4 lanes each
    w[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; i++)  // 2 lanes each
    w[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(w[2 * i], w[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return F16{{__builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
              __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31)}};
}
#elif SIMD_W == 8
inline F16 half(F16 a) { return F16{{a.p[0] + a.p[1], V{}}}; }
// 8 folded vectors' sums in one: quarters (l + 4), then l + 2, then l + 1; inputs in the order that leaves vector j's
// sum in lane j
inline V sums8(V u0, V u1, V u2, V u3, V u4, V u5, V u6, V u7) {
  auto quarters = [](V a, V b) {  // a's l + l + 4 in lanes 0-3, b's in 4-7
    return (V)_mm256_add_ps(_mm256_permute2f128_ps((__m256)a, (__m256)b, 0x20),
                            _mm256_permute2f128_ps((__m256)a, (__m256)b, 0x31));
  };
  const __m256 p0 = (__m256)quarters(u0, u4), p1 = (__m256)quarters(u1, u5), p2 = (__m256)quarters(u2, u6),
               p3 = (__m256)quarters(u3, u7);
  const __m256 q0 = _mm256_add_ps(_mm256_shuffle_ps(p0, p1, 0x44), _mm256_shuffle_ps(p0, p1, 0xEE));  // l + 2
  const __m256 q1 = _mm256_add_ps(_mm256_shuffle_ps(p2, p3, 0x44), _mm256_shuffle_ps(p2, p3, 0xEE));
  return (V)_mm256_add_ps(_mm256_shuffle_ps(q0, q1, 0x88), _mm256_shuffle_ps(q0, q1, 0xDD));  // l + 1
}
inline F16 sums16(F16* v) {
  return F16{{sums8(v[0].p[0], v[1].p[0], v[2].p[0], v[3].p[0], v[4].p[0], v[5].p[0], v[6].p[0], v[7].p[0]),
              sums8(v[8].p[0], v[9].p[0], v[10].p[0], v[11].p[0], v[12].p[0], v[13].p[0], v[14].p[0], v[15].p[0])}};
}
#else
inline F16 half(F16 a) { return a; }
inline F16 sums16(F16* v) {
  float out[16];
  for (int j = 0; j < 16; j++) out[j] = sum(v[j]);
  return load16(out);
}
#endif

}  // namespace simd
}  // namespace
