// medusa::attention(q, k, v, mask, scale) = softmax(q k^T * scale) v over the keys each query may see, for the few
// queries of a MEDUSA step, computed so that a query's output depends only on the keys it sees, taken in position
// order: a tree node attending to the prefix and its ancestors gets bitwise what the same token gets in a one-token
// pass over the same keys. SDPA's does not (its tiling depends on the query count and on where masked keys lie).
// With batch-invariant linears (linear.cpp) the whole pass is batch-invariant, so MEDUSA's greedy
// output is plain decoding's bit for bit, whatever the kernels round (int8 activations included).
//
// The queries of a kv group (its query heads, for every tree node) go through the keys together, a tile at a time,
// so a step reads the cache from memory once per group, not once per query head and node; over the prefix they all
// see, a key's vectors are loaded (and widened) once for 4 queries at a time, whose sums build up side by side.
//
// q [B, H, T, D] float32, k and v [B, Hkv, S, D] both float32 or both float16 (a cache of half the bytes, widened
// exactly as read; H a multiple of Hkv: grouped-query attention; rows contiguous), mask [B, T, S] additive (0: seen,
// anything else: not; none: every key) -> [B, T, H, D]. The seen keys are taken in column order, the cache's: the
// prefix, then the tree's nodes, parents before children (position order). The B sequences of a batch are
// independent: the columns a row's mask hides (another row's longer prefix) are never read.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using namespace simd;

constexpr int64_t LANES = 16;
constexpr int64_t MAX_HEAD_DIM = 256;
constexpr int64_t TILE_KEYS = 64;  // keys read by every query of a group before the next: 16 KB of 64-float rows

// softmax(q k^T * scale) v for one query head over the keys at `cols`, in three passes that the caller interleaves
// with other queries' (attend_group): scores, exponentials, weighted values. C: head_dim / 16 when a multiple of 16
// (loads of whole vectors), else 0 (any head_dim, lane by lane). The arithmetic is the same whatever T, the columns'
// places or the other queries: the keys' scores 16 at a time (each key's products summed lane-wise over the head
// dim, then across lanes by sums16), the exponentials 16 keys a vector in the order seen, the weighted values key by
// key, carried from tile to tile in memory (bitwise what registers hold).
template <int C>
inline int64_t chunks_of(int64_t D) {  // vectors in a row of the head dim
  return C ? C : (D + LANES - 1) / LANES;
}

template <int C, typename E>  // E: float, or uint16_t for a float16 cache's bits
inline F16 chunk(const E* x, int64_t c, int64_t D) {
  return C ? load16(x + c * LANES) : load16(x + c * LANES, std::min(LANES, D - c * LANES));
}

struct Query {
  const float* q;
  float* o;
  const std::vector<int64_t>* cols;
  float* p;    // the scores, then the exponentials: cols->size() rounded up to whole vectors, and one more
  F16* out;    // the weighted values so far, head_dim / 16 vectors
  F16 top16;
  float inverse;
};

// N queries at a time over the keys cols[i0:i1] of the first (every one of them sees those keys at those places: the
// shared prefix, or N = 1): a key's vectors are read (and widened) once for all N, whose sums build up side by side.
// Each query's operations and their order are its own whatever N: the same bits.
constexpr int QB = 4;  // queries a pass over the shared keys serves

// the keys' scores, into each query's p; the running maximum in top16
template <int C, int N, typename E>
void scores(Query* qs, const E* K, int64_t i0, int64_t i1, int64_t D, int64_t krow, float scale) {
  const std::vector<int64_t>& cols = *qs[0].cols;
  const int64_t chunks = chunks_of<C>(D);
  F16 q[N][MAX_HEAD_DIM / LANES];
  for (int n = 0; n < N; n++)
    for (int64_t c = 0; c < chunks; c++) q[n][c] = chunk<C>(qs[n].q, c, D);
  for (int64_t i = i0; i < i1; i += LANES) {
    const int64_t count = std::min(LANES, i1 - i);
    F16 acc[N][LANES];
    for (int64_t j = 0; j < LANES; j++) {
      if (j >= count) {
        for (int n = 0; n < N; n++) acc[n][j] = zero();
        continue;
      }
      const E* kp = K + cols[i + j] * krow;
      F16 s[N], k = chunk<C>(kp, 0, D);
      for (int n = 0; n < N; n++) s[n] = q[n][0] * k;
      for (int64_t c = 1; c < chunks; c++) {
        k = chunk<C>(kp, c, D);
        for (int n = 0; n < N; n++) s[n] = fma(q[n][c], k, s[n]);
      }
      for (int n = 0; n < N; n++) acc[n][j] = half(s[n]);
    }
    for (int n = 0; n < N; n++) {
      const F16 s = first(sums16(acc[n]) * scale, count, -INFINITY);
      store16(qs[n].p + i, s);  // past count: keys a later call scores, or the padding (i is not always aligned)
      qs[n].top16 = max(s, qs[n].top16);
    }
  }
}

// the scores' exponentials, in place, and the inverse of their sum
void exponentials(Query& a) {
  const int64_t n = a.cols->size();
  const float top = lane_max(a.top16);
  F16 total = zero();
  for (int64_t i = 0; i < n; i += LANES) {
    const F16 e = first(exp(load16(a.p + i) - top), n - i, 0);
    store16(a.p + i, e);
    total = total + e;
  }
  a.inverse = n ? 1 / sum(total) : 0;
}

// the keys' values, weighted, added to each query's out key by key
template <int C, int N, typename E>
void values(Query* qs, const E* V, int64_t i0, int64_t i1, int64_t D, int64_t vrow) {
  const std::vector<int64_t>& cols = *qs[0].cols;
  // each query's vector c builds up over the keys, its own chain: CB of them at a time, as many as fit the registers
  // (AVX-512: 32 of one F16 each, AVX2: 16 of half one) with the key's CB vectors; a power of two: it divides C
  constexpr int regs = (W == 16 ? 32 : 16) / P - 1, fit = regs / (N + 1);
  constexpr int CB = C == 0 ? 1 : fit >= C ? C : fit >= 4 ? 4 : fit >= 2 ? 2 : 1;
  for (int64_t c0 = 0; c0 < chunks_of<C>(D); c0 += CB) {
    F16 out[N][CB];
    for (int n = 0; n < N; n++)
      for (int b = 0; b < CB; b++) out[n][b] = qs[n].out[c0 + b];
    for (int64_t i = i0; i < i1; i++) {
      F16 v[CB];
      for (int b = 0; b < CB; b++) v[b] = chunk<C>(V + cols[i] * vrow, c0 + b, D);
      for (int n = 0; n < N; n++)
        for (int b = 0; b < CB; b++) out[n][b] = fma(qs[n].p[i], v[b], out[n][b]);
    }
    for (int n = 0; n < N; n++)
      for (int b = 0; b < CB; b++) qs[n].out[c0 + b] = out[n][b];
  }
}

// the group's queries in blocks of QB, then the rest: f(block's first query, integral_constant<int, size>)
template <typename F>
void in_blocks(std::vector<Query>& group, F f) {
  size_t n = 0;
  for (; n + QB <= group.size(); n += QB) f(&group[n], std::integral_constant<int, QB>());
  switch (group.size() - n) {
    case 3: f(&group[n], std::integral_constant<int, 3>()); break;
    case 2: f(&group[n], std::integral_constant<int, 2>()); break;
    case 1: f(&group[n], std::integral_constant<int, 1>()); break;
  }
}

// Queries that share a kv group, tile by tile of keys: a tile's keys (then values) are read from memory once and
// then from L1 by every other query of the group, whose prefix they all see (the cache is read once per group a
// step, not once per query head and tree node); the keys past the shared prefix, query by query.
template <int C, typename E>
FMA_CLONES void attend_group(std::vector<Query>& group, const E* K, const E* V, int64_t D, int64_t krow, int64_t vrow,
                             float scale) {
  int64_t shared = INT64_MAX;  // columns 0 .. shared - 1: seen by every query
  for (const Query& a : group) {
    const std::vector<int64_t>& cols = *a.cols;
    int64_t lo = 0, hi = cols.size();  // the longest run cols[0:m] = 0 .. m - 1 (cols ascend)
    while (lo < hi) {
      const int64_t m = (lo + hi + 1) / 2;
      if (cols[m - 1] == m - 1)
        lo = m;
      else
        hi = m - 1;
    }
    shared = std::min(shared, lo);
  }
  for (int64_t i = 0; i < shared; i += TILE_KEYS)
    in_blocks(group, [&](Query* qs, auto n) {
      scores<C, decltype(n)::value, E>(qs, K, i, std::min(shared, i + TILE_KEYS), D, krow, scale);
    });
  for (Query& a : group) scores<C, 1, E>(&a, K, shared, a.cols->size(), D, krow, scale);
  for (Query& a : group) exponentials(a);
  for (int64_t i = 0; i < shared; i += TILE_KEYS)
    in_blocks(group, [&](Query* qs, auto n) {
      values<C, decltype(n)::value, E>(qs, V, i, std::min(shared, i + TILE_KEYS), D, vrow);
    });
  for (Query& a : group) values<C, 1, E>(&a, V, shared, a.cols->size(), D, vrow);
  const int64_t chunks = chunks_of<C>(D);
  for (Query& a : group)
    for (int64_t c = 0; c < chunks; c++) store16(a.o + c * LANES, a.out[c] * a.inverse, std::min(LANES, D - c * LANES));
}

}  // namespace

namespace medusa {

using namespace simd;

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                     double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(0) == k.size(0) && q.size(3) == k.size(3),
              "medusa::attention: q [B, H, T, D], k and v [B, Hkv, S, D]");
  const bool float16 = k.scalar_type() == at::kHalf;  // a float16 cache, widened as it is read
  TORCH_CHECK(q.scalar_type() == at::kFloat && (float16 || k.scalar_type() == at::kFloat) &&
              v.scalar_type() == k.scalar_type(), "medusa::attention: q float32, k and v both float32 or both float16");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0 && D <= MAX_HEAD_DIM, "medusa::attention: H a multiple of Hkv, D <= 256");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "medusa::attention: k and v rows contiguous");
  std::vector<std::vector<int64_t>> seen(B * T);  // per row and query, the columns it sees, in order
  const at::Tensor m = mask.has_value() ? mask->contiguous() : at::Tensor();
  if (mask.has_value())
    TORCH_CHECK(m.dim() == 3 && m.size(0) == B && m.size(1) == T && m.size(2) == S && m.scalar_type() == at::kFloat,
                "medusa::attention: float32 mask [B, T, S]");
  if (B * T * H * D == 0) return q.new_empty({B, T, H, D});  // nothing to attend (the splits below divide)
  at::parallel_for(0, B * T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; bt++) {  // branch-free: a compiled engine's mask spans the cache's capacity
      std::vector<int64_t>& cols = seen[bt];
      cols.resize(S);
      int64_t count = 0;
      const float* row = mask.has_value() ? m.data_ptr<float>() + bt * S : nullptr;
      for (int64_t j = 0; j < S; j++) {
        cols[count] = j;
        count += !row || row[j] == 0;
      }
      cols.resize(count);
    }
  });
  const int64_t G = H / Hkv;
  const at::Tensor qc = q.transpose(1, 2).contiguous();  // [B, T, H, D]: a query's heads side by side
  at::Tensor out = q.new_empty({B, T, H, D});
  const float* Q = qc.data_ptr<float>();
  float* O = out.data_ptr<float>();
  // tasks: each kv group's G * T queries in `parts` runs, so that 2 threads share SmolLM2's 3 groups evenly
  const int64_t queries = G * T, groups = B * Hkv;
  const int64_t parts = std::min(queries, std::max<int64_t>(1, (2 * at::get_num_threads() + groups - 1) / groups));
  const int64_t per = (queries + parts - 1) / parts;
  const auto run = [&](const auto* K, const auto* V, std::vector<Query>& group) {
    using E = std::decay_t<decltype(*K)>;
    const auto kernel = D % LANES == 0 && D / LANES == 4   ? attend_group<4, E>
                        : D % LANES == 0 && D / LANES == 8 ? attend_group<8, E>
                                                           : attend_group<0, E>;
    kernel(group, K, V, D, k.stride(2), v.stride(2), float(scale));
  };
  at::parallel_for(0, groups * parts, 1, [&](int64_t begin, int64_t end) {
    const int64_t padded = (S + 2 * LANES - 1) / LANES * LANES, chunks = chunks_of<0>(D);
    std::vector<float> p(per * padded);
    std::vector<F16> outs(per * chunks);
    std::vector<Query> group;
    for (int64_t task = begin; task < end; task++) {
      const int64_t b = task / parts / Hkv, g = task / parts % Hkv, first = task % parts * per;
      group.clear();
      for (int64_t i = first; i < std::min(queries, first + per); i++) {  // query i: token i / G, head g * G + i % G
        const int64_t bt = b * T + i / G, h = g * G + i % G, slot = i - first;
        std::fill(outs.begin() + slot * chunks, outs.begin() + (slot + 1) * chunks, zero());
        group.push_back({Q + (bt * H + h) * D, O + (bt * H + h) * D, &seen[bt], p.data() + slot * padded,
                         outs.data() + slot * chunks, splat16(-INFINITY), 0});
      }
      const int64_t kat = b * k.stride(0) + g * k.stride(1), vat = b * v.stride(0) + g * v.stride(1);
      if (float16)
        run(reinterpret_cast<const uint16_t*>(k.data_ptr<at::Half>()) + kat,
            reinterpret_cast<const uint16_t*>(v.data_ptr<at::Half>()) + vat, group);
      else
        run(k.data_ptr<float>() + kat, v.data_ptr<float>() + vat, group);
    }
  });
  return out;
}

}  // namespace medusa
