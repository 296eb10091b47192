// Paged attention for CPU: one call per layer for every sequence of a step.
//
// Algorithm: flash attention (Dao et al. 2022): keys are visited in tiles of 16 positions,
// each query row keeps a running max m, a running sum l and an unnormalised fp32 output O,
// rescaled by exp(m_old - m_new) when the max grows (online softmax, Milakov & Gimelshein
// 2018). K/V are read straight from the paged pool (PagedAttention, Kwon et al. 2023)
// through the block table; GQA (Ainslie et al. 2023): the heads/kv_heads query heads of one
// KV head are rows of the same tile, so every K/V tile is loaded once for all of them.
//
// Layout of the work, all in "transposed" form so that softmax needs no horizontal ops:
//   * a micro-tile is 16 query rows, a row being (query position, query head of the group);
//     Q^T [D][16] holds q * scale * log2(e) (scores are then in base 2);
//   * a key tile is 16 key positions gathered into fp32 K [16][D] and V [16][D];
//   * S^T[j] (one 16-lane vector per key j) = sum_d Q^T[d] * K[j][d]: 16 accumulators;
//   * the running max/sum are lane-wise vector ops over S^T[0..15];
//   * O^T [D][16] += P^T[j] * V[j][d], 16 output dims at a time.
// Tiles that the causal / sliding-window mask hides completely are skipped; the mask is
// applied only to tiles that straddle it. Every row sees the same key tiles in the same
// order whatever the step looked like (tiles are aligned to absolute key positions, masked
// keys contribute exact zeros), so a prompt computed cold and the same prompt's suffix after
// a prefix-cache hit give bit-identical attention outputs.
//
// Entry point (registered as torch.ops.kvmesh.paged_attention):
//   q            [T, H, D] float32 or bfloat16 (last dim contiguous)
//   kv_cache     [num_blocks, layers, 2, kv_heads, block_size, D], float32 or bfloat16
//   layer_idx    layer of the pool to read
//   query_start  [S + 1] int64: sequence s owns rows query_start[s] .. query_start[s+1]-1 of q
//   context_lens [S] int64: tokens cached before this step (position of the first new token)
//   block_tables [S, max_blocks] int64, padded; entries past a sequence's blocks are not read
//   block_size   tokens per block (must equal kv_cache.size(4))
//   window       sliding window (a key at p is visible to a query at t iff t - window < p <= t), or -1
//   scale        score scale, usually 1/sqrt(D)
// returns out [T, H, D] in q's dtype. Accumulation is fp32 throughout.

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVMESH_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kvmesh_attn {

constexpr int L = 16;  // rows per micro-tile = keys per key tile = lanes per vector
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#ifdef __AVX512F__
struct V { __m512 v; };
using M = __mmask16;
static inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a.v); }
static inline V vset1(float x) { return {_mm512_set1_ps(x)}; }
static inline V vzero() { return {_mm512_setzero_ps()}; }
static inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
static inline V vmul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline V vadd(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline V vsub(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
static inline V vmax(V a, V b) { return {_mm512_max_ps(a.v, b.v)}; }
static inline V vdiv(V a, V b) { return {_mm512_div_ps(a.v, b.v)}; }
static inline M vle(V a, V b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_LE_OQ); }
static inline M vgt(V a, V b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ); }
static inline M veq(V a, V b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ); }
static inline M mand(M a, M b) { return static_cast<M>(a & b); }
static inline V vkeep(M m, V a) { return {_mm512_maskz_mov_ps(m, a.v)}; }                      // a where m, else 0
static inline V vfill(V a, M m, float x) { return {_mm512_mask_mov_ps(a.v, m, _mm512_set1_ps(x))}; }  // x where m
static inline V vfill_not(V a, M m, float x) { return vfill(a, static_cast<M>(~m), x); }
static inline V vround(V a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
static inline V vscalef(V a, V e) { return {_mm512_scalef_ps(a.v, e.v)}; }
// 16 floats -> bfloat16 bits, nearest even, as c10::BFloat16 does it (denormals kept, NaN ->
// 0x7FC0); vcvtneps2bf16 would flush denormal inputs to zero
static inline __m256i bf16_bits(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
static inline void bf16_to_f32_16(const c10::BFloat16* src, float* dst) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  _mm512_storeu_ps(dst, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA (x86-64-v3): a 16-lane vector is two 8-lane halves; masks are 16-bit lane masks
// as with AVX-512. Every lane goes through the same IEEE operations as in the portable code.
#define KVMESH_AVX2 1
struct V { __m256 lo, hi; };
using M = uint32_t;
static inline __m256 lane_mask8(uint32_t bits) {  // all-ones in the lanes whose bit is set
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i b = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits & 0xffu)), sel);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, sel));
}
static inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vstore(float* p, V a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
static inline V vset1(float x) { const __m256 b = _mm256_set1_ps(x); return {b, b}; }
static inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V vfma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
static inline V vmul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline V vadd(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline V vsub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
// maxps(a, b) = a > b ? a : b, as in the portable code
static inline V vmax(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
static inline V vdiv(V a, V b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
template <int kCmp>
static inline M vcmp(V a, V b) {
  return static_cast<M>(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, kCmp)))
         | (static_cast<M>(_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, kCmp))) << 8);
}
static inline M vle(V a, V b) { return vcmp<_CMP_LE_OQ>(a, b); }
static inline M vgt(V a, V b) { return vcmp<_CMP_GT_OQ>(a, b); }
static inline M veq(V a, V b) { return vcmp<_CMP_EQ_OQ>(a, b); }
static inline M mand(M a, M b) { return a & b; }
static inline V vkeep(M m, V a) {
  return {_mm256_and_ps(lane_mask8(m), a.lo), _mm256_and_ps(lane_mask8(m >> 8), a.hi)};
}
static inline V vfill(V a, M m, float x) {
  const __m256 b = _mm256_set1_ps(x);
  return {_mm256_blendv_ps(a.lo, b, lane_mask8(m)), _mm256_blendv_ps(a.hi, b, lane_mask8(m >> 8))};
}
static inline V vfill_not(V a, M m, float x) { return vfill(a, ~m & 0xffffu, x); }
static inline V vround(V a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// a * 2^e for integer-valued e in [-127, 0] (all vexp2 asks): two exact power-of-two
// factors 2^(e/2) (normal floats), so the product rounds once, as ldexp does; a NaN e comes
// with a NaN a, and the product stays NaN whatever the factors
static inline __m256 scalef8(__m256 a, __m256 e) {
  const __m256i n = _mm256_cvtps_epi32(e);
  const __m256i n1 = _mm256_srai_epi32(n, 1);
  const __m256i n2 = _mm256_sub_epi32(n, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(a, f1), f2);
}
static inline V vscalef(V a, V e) { return {scalef8(a.lo, e.lo), scalef8(a.hi, e.hi)}; }
static inline void bf16_to_f32_16(const c10::BFloat16* src, float* dst) {
  for (int h = 0; h < 2; ++h) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 8 * h));
    _mm256_storeu_ps(dst + 8 * h, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)));
  }
}
#else
struct V { float v[L]; };
using M = uint32_t;
static inline V vload(const float* p) { V r; std::memcpy(r.v, p, sizeof(r.v)); return r; }
static inline void vstore(float* p, V a) { std::memcpy(p, a.v, sizeof(a.v)); }
static inline V vset1(float x) { V r; for (int i = 0; i < L; ++i) r.v[i] = x; return r; }
static inline V vzero() { return vset1(0.f); }
static inline V vfma(V a, V b, V c) { V r; for (int i = 0; i < L; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return r; }
static inline V vmul(V a, V b) { V r; for (int i = 0; i < L; ++i) r.v[i] = a.v[i] * b.v[i]; return r; }
static inline V vadd(V a, V b) { V r; for (int i = 0; i < L; ++i) r.v[i] = a.v[i] + b.v[i]; return r; }
static inline V vsub(V a, V b) { V r; for (int i = 0; i < L; ++i) r.v[i] = a.v[i] - b.v[i]; return r; }
static inline V vmax(V a, V b) { V r; for (int i = 0; i < L; ++i) r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]; return r; }
static inline V vdiv(V a, V b) { V r; for (int i = 0; i < L; ++i) r.v[i] = a.v[i] / b.v[i]; return r; }
static inline M vle(V a, V b) { M m = 0; for (int i = 0; i < L; ++i) m |= (a.v[i] <= b.v[i] ? 1u : 0u) << i; return m; }
static inline M vgt(V a, V b) { M m = 0; for (int i = 0; i < L; ++i) m |= (a.v[i] > b.v[i] ? 1u : 0u) << i; return m; }
static inline M veq(V a, V b) { M m = 0; for (int i = 0; i < L; ++i) m |= (a.v[i] == b.v[i] ? 1u : 0u) << i; return m; }
static inline M mand(M a, M b) { return a & b; }
static inline V vkeep(M m, V a) { V r; for (int i = 0; i < L; ++i) r.v[i] = (m >> i) & 1u ? a.v[i] : 0.f; return r; }
static inline V vfill(V a, M m, float x) { V r; for (int i = 0; i < L; ++i) r.v[i] = (m >> i) & 1u ? x : a.v[i]; return r; }
static inline V vfill_not(V a, M m, float x) { return vfill(a, ~m, x); }
static inline V vround(V a) { V r; for (int i = 0; i < L; ++i) r.v[i] = std::nearbyint(a.v[i]); return r; }
static inline V vscalef(V a, V e) { V r; for (int i = 0; i < L; ++i) r.v[i] = std::ldexp(a.v[i], e.v[i] == e.v[i] ? static_cast<int>(e.v[i]) : 0); return r; }  // NaN: a is NaN too
static inline void bf16_to_f32_16(const c10::BFloat16* src, float* dst) {
  for (int i = 0; i < L; ++i) dst[i] = static_cast<float>(src[i]);
}
#endif

// 2^x for x <= 0 (scores minus the running max): x = n + f with n = round(x), |f| <= 1/2,
// 2^f by its Taylor series to degree 7 (truncation error < 1e-8, below fp32 rounding), then
// scaled by 2^n. Inputs below -127 are clamped (the result, < 6e-39, only ever multiplies
// zeros or is masked out). 2^0 is exactly 1. NaN stays NaN (vmax returns its second operand
// when the comparison fails), so a NaN score makes its row's output NaN, as in torch's SDPA.
// (kDeg < 7: the series cut at that degree, for a p rounded to bfloat16 right after.)
constexpr float kExp2Taylor[8] = {1.0f, 6.931471805599453e-01f, 2.402265069591007e-01f, 5.550410866482158e-02f,
                                  9.618129107628477e-03f, 1.3333558146428443e-03f, 1.5403530393381606e-04f,
                                  1.525273380405984e-05f};  // (ln 2)^k / k!
template <int kDeg = 7>
static inline V vexp2(V x) {
  x = vmax(vset1(-127.f), x);
  V n = vround(x);
  V f = vsub(x, n);
  V p = vset1(kExp2Taylor[kDeg]);
  for (int k = kDeg - 1; k >= 0; --k) p = vfma(p, f, vset1(kExp2Taylor[k]));
  return vscalef(p, n);
}

template <typename T> static inline float to_f(T x) { return static_cast<float>(x); }

template <typename T>
static inline void row_to_f32(const T* src, float* dst, int64_t d) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; i + L <= d; i += L) bf16_to_f32_16(src + i, dst + i);
  }
  for (; i < d; ++i) dst[i] = to_f(src[i]);
}

// S^T[j][0..16) = sum_d Q^T[d][0..16) * K^T[d][j] for the 16 keys j of a tile: 16 accumulators.
__attribute__((noinline)) static void qk_tile(const float* qt, const float* kt, int64_t D, float* s) {
#ifdef KVMESH_AVX2
  // 16 ymm registers hold 8 accumulators (both row halves x 4 keys) at a time, not 32
  for (int j0 = 0; j0 < L; j0 += 4) {
    __m256 acc[2][4];
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j) acc[h][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m256 q0 = _mm256_loadu_ps(qt + d * L), q1 = _mm256_loadu_ps(qt + d * L + 8);
      const float* k = kt + d * L + j0;
      for (int j = 0; j < 4; ++j) {
        const __m256 kj = _mm256_broadcast_ss(k + j);
        acc[0][j] = _mm256_fmadd_ps(q0, kj, acc[0][j]);
        acc[1][j] = _mm256_fmadd_ps(q1, kj, acc[1][j]);
      }
    }
    for (int j = 0; j < 4; ++j) {
      _mm256_storeu_ps(s + (j0 + j) * L, acc[0][j]);
      _mm256_storeu_ps(s + (j0 + j) * L + 8, acc[1][j]);
    }
  }
#else
  V acc[L];
  for (int j = 0; j < L; ++j) acc[j] = vzero();
  for (int64_t d = 0; d < D; ++d) {
    const V qv = vload(qt + d * L);
    const float* k = kt + d * L;
    for (int j = 0; j < L; ++j) acc[j] = vfma(qv, vset1(k[j]), acc[j]);
  }
  for (int j = 0; j < L; ++j) vstore(s + j * L, acc[j]);
#endif
}

#ifdef __AVX512BF16__
// The same S^T for a bfloat16 Q and pool with AVX512_BF16: Q^T holds (q[d], q[d+1]) pairs of
// 16 rows ([D/2][16] 32-bit words), K the keys' own (k[d], k[d+1]) pairs ([16][D/2], copied
// from the pool as they are); vdpbf16ps adds two exact products per lane and instruction, twice
// the multiply-adds of an fp32 FMA. Q is not pre-scaled (rounding q * scale to bfloat16 would
// lose precision): the sums are multiplied by the scale afterwards.
__attribute__((noinline)) static void qk_tile_pairs(const uint32_t* qt2, const uint32_t* kp, int64_t D2, float qmul,
                                                    float* s) {
  __m512 acc[L];
  for (int j = 0; j < L; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D2; ++i) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(qt2 + i * L);
    for (int j = 0; j < L; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_set1_epi32(static_cast<int>(kp[j * D2 + i])));
  }
  const __m512 m = _mm512_set1_ps(qmul);
  for (int j = 0; j < L; ++j) _mm512_storeu_ps(s + j * L, _mm512_mul_ps(acc[j], m));
}

// x rounded to the nearest bfloat16 (kept as fp32): the P that pv_tile_pairs multiplies.
static inline V round_bf16(V x) {
  const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x.v));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(h, 16))};
}

// O^T = alpha * O^T + P^T V with bfloat16 pairs: P^T (already rounded to bfloat16 by the
// caller, so that the row sums l use the same values) is packed as (p[2k], p[2k+1]) pairs per
// row, V as (v[2k][d], v[2k+1][d]) pairs ([L/2][D] 32-bit words); fp32 accumulation.
__attribute__((noinline)) static void pv_tile_pairs(float* ot, const float* pt, const uint32_t* vp, V alpha_v,
                                                    int64_t D) {
  const __m512 alpha = alpha_v.v;
  __m512i pp[L / 2];
  for (int k = 0; k < L / 2; ++k) {
    const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(pt + 2 * k * L)));
    const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(pt + (2 * k + 1) * L)));
    pp[k] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
  }
  int64_t d0 = 0;
  for (; d0 + L <= D; d0 += L) {
    __m512 o[L];
    for (int dd = 0; dd < L; ++dd) o[dd] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d0 + dd) * L), alpha);
    for (int k = 0; k < L / 2; ++k) {
      const uint32_t* vr = vp + k * D + d0;
      for (int dd = 0; dd < L; ++dd)
        o[dd] = _mm512_dpbf16_ps(o[dd], (__m512bh)pp[k], (__m512bh)_mm512_set1_epi32(static_cast<int>(vr[dd])));
    }
    for (int dd = 0; dd < L; ++dd) _mm512_storeu_ps(ot + (d0 + dd) * L, o[dd]);
  }
  for (; d0 < D; ++d0) {
    __m512 o = _mm512_mul_ps(_mm512_loadu_ps(ot + d0 * L), alpha);
    for (int k = 0; k < L / 2; ++k)
      o = _mm512_dpbf16_ps(o, (__m512bh)pp[k], (__m512bh)_mm512_set1_epi32(static_cast<int>(vp[k * D + d0])));
    _mm512_storeu_ps(ot + d0 * L, o);
  }
}
// V rows [16][D] (bfloat16 bits) -> (v[2k][d], v[2k+1][d]) pairs [8][D], 16 dims at a time.
static void pack_v_pairs(const uint16_t* vraw, uint32_t* vp, int64_t D) {
  for (int k = 0; k < L / 2; ++k) {
    const uint16_t* a = vraw + 2 * k * D;
    const uint16_t* b = a + D;
    uint32_t* dst = vp + k * D;
    int64_t d = 0;
    for (; d + L <= D; d += L) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d)));
      const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d)));
      _mm512_storeu_si512(dst + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
    for (; d < D; ++d) dst[d] = static_cast<uint32_t>(a[d]) | (static_cast<uint32_t>(b[d]) << 16);
  }
}
constexpr bool kHavePairs = true;
#else
static void pack_v_pairs(const uint16_t*, uint32_t*, int64_t) {}
static void qk_tile_pairs(const uint32_t*, const uint32_t*, int64_t, float, float*) {}
static void pv_tile_pairs(float*, const float*, const uint32_t*, V, int64_t) {}
static inline V round_bf16(V x) { return x; }
constexpr bool kHavePairs = false;
#endif

// O^T[d] = alpha * O^T[d] + sum_j P^T[j] * V[j][d], 16 output dims at a time (V is [16][D]).
__attribute__((noinline)) static void pv_tile(float* ot, const float* pt, const float* vb, V alpha, int64_t D) {
  int64_t d0 = 0;
#ifdef KVMESH_AVX2
  // 4 output dims x both row halves = 8 accumulators per pass (16 ymm registers)
  for (; d0 + 4 <= D; d0 += 4) {
    __m256 o[4][2];
    for (int dd = 0; dd < 4; ++dd) {
      o[dd][0] = _mm256_mul_ps(_mm256_loadu_ps(ot + (d0 + dd) * L), alpha.lo);
      o[dd][1] = _mm256_mul_ps(_mm256_loadu_ps(ot + (d0 + dd) * L + 8), alpha.hi);
    }
    for (int j = 0; j < L; ++j) {
      const __m256 p0 = _mm256_loadu_ps(pt + j * L), p1 = _mm256_loadu_ps(pt + j * L + 8);
      const float* vr = vb + j * D + d0;
      for (int dd = 0; dd < 4; ++dd) {
        const __m256 v = _mm256_broadcast_ss(vr + dd);
        o[dd][0] = _mm256_fmadd_ps(p0, v, o[dd][0]);
        o[dd][1] = _mm256_fmadd_ps(p1, v, o[dd][1]);
      }
    }
    for (int dd = 0; dd < 4; ++dd) {
      _mm256_storeu_ps(ot + (d0 + dd) * L, o[dd][0]);
      _mm256_storeu_ps(ot + (d0 + dd) * L + 8, o[dd][1]);
    }
  }
#endif
  for (; d0 + L <= D; d0 += L) {
    V o[L];
    for (int dd = 0; dd < L; ++dd) o[dd] = vmul(vload(ot + (d0 + dd) * L), alpha);
    for (int j = 0; j < L; ++j) {
      const V pj = vload(pt + j * L);
      const float* vr = vb + j * D + d0;
      for (int dd = 0; dd < L; ++dd) o[dd] = vfma(pj, vset1(vr[dd]), o[dd]);
    }
    for (int dd = 0; dd < L; ++dd) vstore(ot + (d0 + dd) * L, o[dd]);
  }
  for (; d0 < D; ++d0) {
    V o = vmul(vload(ot + d0 * L), alpha);
    for (int j = 0; j < L; ++j) o = vfma(vload(pt + j * L), vset1(vb[j * D + d0]), o);
    vstore(ot + d0 * L, o);
  }
}

// Micro-tiles with few valid rows (decodes: heads / kv_heads rows per sequence) take the
// scores from the tile function as usual, then do the softmax and P V row by row with the
// output dims in the lanes: P V costs 1/16 of a full tile's multiply-adds per row instead of
// a full tile's whatever the row count. Every element goes through the same operations in
// the same order as in the row-lane code (exact maxima, p summed in key order, the same
// exp2, the same FMAs or pair products in key order), so a row's result does not depend on
// which path computed it: cold and cached rows stay bit-identical.
constexpr int64_t kSparseRows = 8;  // tiles with fewer valid rows take the key-lane path

// O row (row-major [D]) = alpha * O + sum_j p[j] * V[j][:]
static inline void pv_row(float* orow, const float* p, const float* vb, float alpha, int64_t D) {
  int64_t d0 = 0;
  for (; d0 + L <= D; d0 += L) {
    V o = vmul(vload(orow + d0), vset1(alpha));
    for (int j = 0; j < L; ++j) o = vfma(vset1(p[j]), vload(vb + j * D + d0), o);
    vstore(orow + d0, o);
  }
  for (; d0 < D; ++d0) {
    float o = orow[d0] * alpha;
    for (int j = 0; j < L; ++j) o = std::fma(p[j], vb[j * D + d0], o);
    orow[d0] = o;
  }
}

#ifdef __AVX512BF16__
// p holds bfloat16 values (as fp32); V as (v[2k][d], v[2k+1][d]) pairs [L/2][D]
static inline void pv_row_pairs(float* orow, const float* p, const uint32_t* vp, float alpha, int64_t D) {
  uint32_t pw[L / 2];
  for (int k = 0; k < L / 2; ++k) {
    uint32_t lo, hi;
    std::memcpy(&lo, p + 2 * k, 4);
    std::memcpy(&hi, p + 2 * k + 1, 4);
    pw[k] = (lo >> 16) | (hi & 0xffff0000u);
  }
  int64_t d0 = 0;
  for (; d0 + L <= D; d0 += L) {
    __m512 o = _mm512_mul_ps(_mm512_loadu_ps(orow + d0), _mm512_set1_ps(alpha));
    for (int k = 0; k < L / 2; ++k)
      o = _mm512_dpbf16_ps(o, (__m512bh)_mm512_loadu_si512(vp + k * D + d0),
                           (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[k])));
    _mm512_storeu_ps(orow + d0, o);
  }
  for (; d0 < D; ++d0) {  // D % 16 lanes: one lane of the same instruction
    __m512 o = _mm512_set1_ps(orow[d0] * alpha);
    for (int k = 0; k < L / 2; ++k)
      o = _mm512_dpbf16_ps(o, (__m512bh)_mm512_set1_epi32(static_cast<int>(vp[k * D + d0])),
                           (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[k])));
    orow[d0] = _mm512_cvtss_f32(o);
  }
}
#else
static inline void pv_row_pairs(float*, const float*, const uint32_t*, float, int64_t) {}
#endif

struct Item {
  int64_t seq, kvh, r0, r1;  // rows [r0, r1) of the sequence's (position, head-in-group) rows
  double cost;
};

struct Args {
  int64_t D, H, KVH, G, BS, window;
  float qmul;  // scale * log2(e)
  bool amx;    // bf16 Q and pool, D % 32 == 0 and <= 256, block_size % 16 == 0, AMX built, granted and wanted
  const uint32_t* vt_shared = nullptr;  // AMX: V^T spans packed once per call (pack_shared_vt)
  const int64_t* vt_off = nullptr;
  const int64_t *qstart, *ctx, *tables;
  int64_t table_stride;
  int64_t q_s0, q_s1;      // q strides (elements) of dims 0 and 1
  int64_t p_sb, p_skv, p_sh, p_st;  // pool strides: block, K/V, kv head, token (layer folded into base)
  int64_t o_s0, o_s1;
};

// Per-thread scratch, reused across items.
struct Scratch {
  std::vector<float> qt, ot, m, l, pos, lo, kb, vb, p, tmp, tmpk;
  std::vector<uint32_t> qt2, kp, vp;  // bfloat16 pairs (qk_tile_pairs, pv_tile_pairs)
  std::vector<uint16_t> vraw;          // the tile's 16 V rows as bfloat16 bits [16][D]
  std::vector<float> orow;             // row-major O of the last micro-tile when it is sparse [L][D]
  std::vector<int64_t> tmin, tmax;
};

// Where an item's rows sit: its sequence's first query row, cached context and length with
// the new tokens (positions), block table, and the item's row and micro-tile counts.
struct ItemGeom {
  int64_t qs, c, total, nrows, ntiles;
  const int64_t* table;
  ItemGeom(const Args& a, const Item& it)
      : qs(a.qstart[it.seq]), c(a.ctx[it.seq]), total(c + a.qstart[it.seq + 1] - qs), nrows(it.r1 - it.r0),
        ntiles((nrows + L - 1) / L), table(a.tables + it.seq * a.table_stride) {}
};

// The positions of an item's rows, micro-tile by micro-tile, into s.pos / s.lo (the window's
// edge) / s.tmin / s.tmax (padded lanes repeat the last row's position), and put(tile, lane,
// q row) for each real row.
template <typename QT, typename F>
static void item_rows(const Args& a, const Item& it, const ItemGeom& g, const QT* q, Scratch& s, F put) {
  const int64_t G = a.G, W = a.window;
  s.pos.resize(g.ntiles * L);
  s.lo.resize(g.ntiles * L);
  s.tmin.resize(g.ntiles);
  s.tmax.resize(g.ntiles);
  for (int64_t r = 0; r < g.ntiles * L; ++r) {
    const int64_t rr = std::min(it.r0 + r, it.r1 - 1);
    const int64_t i = rr / G;
    const int64_t pos = g.c + i;
    const int64_t t = r / L, lane = r % L;
    s.pos[r] = static_cast<float>(pos);
    s.lo[r] = W > 0 ? static_cast<float>(pos - W) : -1.f;
    if (lane == 0) s.tmin[t] = pos;
    s.tmax[t] = pos;
    if (it.r0 + r < it.r1) put(t, lane, q + (g.qs + i) * a.q_s0 + (it.kvh * G + rr % G) * a.q_s1);
  }
}

template <typename QT, typename KT>
static void run_item(const Args& a, const Item& it, const QT* q, const KT* pool, QT* out, Scratch& s) {
  const int64_t D = a.D, G = a.G, BS = a.BS, W = a.window;
  const ItemGeom g(a, it);
  const int64_t qs = g.qs, total = g.total, nrows = g.nrows, ntiles = g.ntiles;
  const int64_t* table = g.table;
  // bfloat16 Q and pool on a CPU with AVX512_BF16: scores by bf16 pair dot products
  constexpr bool kPairTypes = kHavePairs && std::is_same_v<QT, c10::BFloat16> && std::is_same_v<KT, c10::BFloat16>;
  const bool pairs = kPairTypes && D % 2 == 0;
  const int64_t D2 = D / 2;

  if (pairs) {
    s.qt2.assign(ntiles * D2 * L, 0u);
    s.kp.resize(L * D2);
    s.vp.resize(L / 2 * D);
    s.vraw.resize(L * D);
  } else {
    s.qt.assign(ntiles * D * L, 0.f);
  }
  s.ot.assign(ntiles * D * L, 0.f);
  // only the last micro-tile can have fewer than 16 rows, so only it can take the row path
  if (nrows - (ntiles - 1) * L < kSparseRows) s.orow.assign(L * D, 0.f);
  s.m.assign(ntiles * L, kNegInf);
  s.l.assign(ntiles * L, 0.f);
  s.kb.resize(L * D);
  s.vb.resize(L * D);
  s.p.resize(L * L);
  s.tmp.resize(L);

  // Q^T per micro-tile: bf16 pairs, or fp32 pre-multiplied by scale * log2(e)
  item_rows(a, it, g, q, s, [&](int64_t t, int64_t lane, const QT* qr) {
    if (pairs) {
      uint32_t* dst2 = s.qt2.data() + t * D2 * L + lane;
      for (int64_t k = 0; k < D2; ++k) std::memcpy(dst2 + k * L, qr + 2 * k, sizeof(uint32_t));
    } else {
      float* dst = s.qt.data() + t * D * L + lane;
      for (int64_t d = 0; d < D; ++d) dst[d * L] = to_f(qr[d]) * a.qmul;
    }
  });
  const int64_t first = s.tmin[0], last = s.tmax[ntiles - 1];
  const int64_t k_lo = W > 0 ? std::max<int64_t>(0, first - W + 1) : 0;
  const int64_t kt_lo = k_lo / L, kt_hi = last / L;
  float* kb = s.kb.data();
  float* vb = s.vb.data();
  float* pb = s.p.data();
  s.tmpk.resize(D);
  float* tmpk = s.tmpk.data();

  for (int64_t kt = kt_lo; kt <= kt_hi; ++kt) {
    const int64_t kbase = kt * L;
    // gather 16 keys/values into fp32 rows; positions past the sequence read nothing
    for (int j = 0; j < L; ++j) {
      const int64_t p = kbase + j;
      if (p >= total) {
        if (pairs) {
          std::fill(s.kp.data() + j * D2, s.kp.data() + (j + 1) * D2, 0u);
          std::fill(s.vraw.data() + j * D, s.vraw.data() + (j + 1) * D, uint16_t{0});
        } else {
          for (int64_t d = 0; d < D; ++d) kb[d * L + j] = 0.f;
          std::fill(vb + j * D, vb + (j + 1) * D, 0.f);
        }
        continue;
      }
      const KT* src = pool + table[p / BS] * a.p_sb + it.kvh * a.p_sh + (p % BS) * a.p_st;
      if (pairs) {
        std::memcpy(s.kp.data() + j * D2, src, D * sizeof(KT));  // the key's own bf16 pairs
        std::memcpy(s.vraw.data() + j * D, src + a.p_skv, D * sizeof(KT));
      } else {
        row_to_f32(src, tmpk, D);
        for (int64_t d = 0; d < D; ++d) kb[d * L + j] = tmpk[d];  // K^T [D][16]
        row_to_f32(src + a.p_skv, vb + j * D, D);
      }
    }
    if (pairs) pack_v_pairs(s.vraw.data(), s.vp.data(), D);
    const int64_t kend = kbase + L - 1;
    for (int64_t t = 0; t < ntiles; ++t) {
      const int64_t tmin = s.tmin[t], tmax = s.tmax[t];
      if (kbase > tmax) continue;                   // all keys in every row's future
      if (W > 0 && kend <= tmin - W) continue;      // all keys before every row's window
      const bool masked = kend > tmin || (W > 0 && kbase <= tmax - W);
      const int64_t nvalid = std::min<int64_t>(L, nrows - t * L);
      if (pairs)
        qk_tile_pairs(s.qt2.data() + t * D2 * L, s.kp.data(), D2, a.qmul, pb);
      else
        qk_tile(s.qt.data() + t * D * L, kb, D, pb);
      if (nvalid < kSparseRows) {  // few rows (decodes): softmax and P V row by row
        float kpos_f[L];
        for (int j = 0; j < L; ++j) kpos_f[j] = static_cast<float>(kbase + j);
        const V kpos = vload(kpos_f);
        for (int64_t lane = 0; lane < nvalid; ++lane) {
          const int64_t r = t * L + lane;
          float sr[L];
          for (int j = 0; j < L; ++j) sr[j] = pb[j * L + lane];  // this row's scores (S^T column)
          V sc = vload(sr);
          M ok = static_cast<M>(0xFFFFu);
          if (masked) {
            ok = mand(vle(kpos, vset1(s.pos[r])), vgt(kpos, vset1(s.lo[r])));
            sc = vfill_not(sc, ok, kNegInf);
          }
          float sv[L];
          vstore(sv, sc);
          const float m_old = s.m[r];
          float m_new = m_old;
          for (int j = 0; j < L; ++j) m_new = std::max(m_new, sv[j]);
          const float m_safe = m_new == kNegInf ? 0.f : m_new;
          float ex[L];
          vstore(ex, vexp2(vset1(m_old - m_safe)));
          const float alpha = ex[0];
          V pv = vexp2(vsub(sc, vset1(m_safe)));
          if (masked) pv = vkeep(ok, pv);
          if (pairs) pv = round_bf16(pv);
          float pr[L];
          vstore(pr, pv);
          float sum = 0.f;
          for (int j = 0; j < L; ++j) sum += pr[j];
          s.m[r] = m_new;
          s.l[r] = std::fma(s.l[r], alpha, sum);
          float* orow = s.orow.data() + lane * D;
          if (pairs)
            pv_row_pairs(orow, pr, s.vp.data(), alpha, D);
          else
            pv_row(orow, pr, vb, alpha, D);
        }
        continue;
      }

      // S^T: one vector (16 rows) per key, computed above
      V acc[L];
      for (int j = 0; j < L; ++j) acc[j] = vload(pb + j * L);
      M valid[L];
      if (masked) {
        const V rp = vload(s.pos.data() + t * L);
        const V rl = vload(s.lo.data() + t * L);
        for (int j = 0; j < L; ++j) {
          const V kp = vset1(static_cast<float>(kbase + j));
          valid[j] = mand(vle(kp, rp), vgt(kp, rl));
          acc[j] = vfill_not(acc[j], valid[j], kNegInf);
        }
      }
      const V m_old = vload(s.m.data() + t * L);
      V m_new = m_old;
      for (int j = 0; j < L; ++j) m_new = vmax(m_new, acc[j]);
      const V m_safe = vfill(m_new, veq(m_new, vset1(kNegInf)), 0.f);
      const V alpha = vexp2(vsub(m_old, m_safe));
      V sum = vzero();
      for (int j = 0; j < L; ++j) {
        V p = vexp2(vsub(acc[j], m_safe));
        if (masked) p = vkeep(valid[j], p);
        if (pairs) p = round_bf16(p);  // the values pv_tile_pairs multiplies, summed alike
        vstore(pb + j * L, p);
        sum = vadd(sum, p);
      }
      vstore(s.m.data() + t * L, m_new);
      vstore(s.l.data() + t * L, vfma(vload(s.l.data() + t * L), alpha, sum));

      // O^T = alpha * O^T + P^T V, 16 output dims at a time
      if (pairs)
        pv_tile_pairs(s.ot.data() + t * D * L, pb, s.vp.data(), alpha, D);
      else
        pv_tile(s.ot.data() + t * D * L, pb, vb, alpha, D);
    }
  }

  // out = O / l
  float* tmp = s.tmp.data();
  for (int64_t t = 0; t < ntiles; ++t) {
    vstore(tmp, vdiv(vset1(1.f), vload(s.l.data() + t * L)));
    const float* ot = s.ot.data() + t * D * L;
    const int64_t lanes = std::min<int64_t>(L, nrows - t * L);
    for (int64_t lane = 0; lane < lanes; ++lane) {
      const int64_t rr = it.r0 + t * L + lane;
      QT* dst = out + (qs + rr / G) * a.o_s0 + (it.kvh * G + rr % G) * a.o_s1;
      const float inv = tmp[lane];
      if (lanes < kSparseRows) {  // computed row by row into row-major O
        const float* orow = s.orow.data() + lane * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<QT>(orow[d] * inv);
      } else {
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<QT>(ot[d * L + lane] * inv);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// AMX path (Intel Advanced Matrix Extensions): bfloat16 Q and pool, head_dim a multiple of 32 up to 256,
// block_size a multiple of 16, on a CPU with AMX-BF16 whose OS grants the tile state
// (Linux: arch_prctl ARCH_REQ_XCOMP_PERM). Keys go in spans of 32 (two 16-key tiles); both
// products are tile dot products (TDPBF16PS: C[m][n] += a(m, pair k) . b(pair k, n), two bf16
// products per pair, fp32 accumulation) in the kernel's transposed layout, so the softmax
// between them keeps its row-per-lane form:
//   S^T [16 keys][16 rows] = K [16 keys][16 pairs] . Q^T pairs [16][16 rows], per 16 keys and
//                            32 dims, K read straight from the pool;
//   O^T [16 dims][16 rows] += V^T pairs [16 dims][16 key pairs] . P^T pairs [16][16 rows].
// Each micro-tile's O^T stays in tile registers over all its keys (the first 4 tiles, 64 dims;
// a larger head_dim's other tiles go through memory at each span). A
// row's max moves only when a span's exceeds it by more than kLazyMax (base 2, so p stays
// <= 2^8), and O^T is rescaled, through memory, only then. Every micro-tile takes this path,
// whatever its number of valid rows, and no row's operations depend on the other rows of its
// micro-tile: cold and cached rows stay bit-identical.
std::atomic<bool> g_amx_wanted{true};  // set_amx

#ifdef KVMESH_AMX
constexpr float kLazyMax = 8.f;

constexpr int64_t kSpan = 2 * L;  // keys per step

static bool amx_granted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // asm/prctl.h, Linux 5.16+
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// All eight tiles are 16 rows x 64 bytes: tmm0 A operand (K, V^T), tmm1 B operand (Q^T, P^T),
// tmm2 / tmm3 S^T of the span's two key tiles (then A operands of P V), tmm4-7 O^T.
static void amx_configure() {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  _tile_loadconfig(&c);
}

// O^T tiles <-> memory [D][16] (tile numbers are immediates)
static inline void o_store(float* ot, int64_t nd) {
  _tile_stored(4, ot, L * 4);
  if (nd > 1) _tile_stored(5, ot + 1 * L * L, L * 4);
  if (nd > 2) _tile_stored(6, ot + 2 * L * L, L * 4);
  if (nd > 3) _tile_stored(7, ot + 3 * L * L, L * 4);
}
static inline void o_load(const float* ot, int64_t nd) {
  _tile_loadd(4, ot, L * 4);
  if (nd > 1) _tile_loadd(5, ot + 1 * L * L, L * 4);
  if (nd > 2) _tile_loadd(6, ot + 2 * L * L, L * 4);
  if (nd > 3) _tile_loadd(7, ot + 3 * L * L, L * 4);
}

constexpr int64_t kNoSharedVt = std::numeric_limits<int64_t>::min();  // a.vt_off: packs its own

// V^T pairs of keys [32 sp, 32 sp + 32) of sequence seq, KV head kvh: vt [D][16 key pairs],
// (v[2k][d], v[2k+1][d]) at [d][k]; V past the sequence reads as 0. vraw: scratch [32][D].
static void pack_vt_span(const Args& a, const c10::BFloat16* pool, int64_t seq, int64_t kvh, int64_t sp, uint32_t* vt,
                         uint16_t* vraw) {
  constexpr int64_t P2 = kSpan / 2;
  const int64_t D = a.D, BS = a.BS;
  const int64_t total = a.ctx[seq] + a.qstart[seq + 1] - a.qstart[seq];
  const int64_t* table = a.tables + seq * a.table_stride;
  const int64_t kbase = sp * kSpan;
  for (int64_t j = 0; j < kSpan; ++j) {
    const int64_t p = kbase + j;
    if (p >= total) {
      std::fill(vraw + j * D, vraw + (j + 1) * D, uint16_t{0});
      continue;
    }
    const c10::BFloat16* src = pool + table[p / BS] * a.p_sb + a.p_skv + kvh * a.p_sh + (p % BS) * a.p_st;
    std::memcpy(vraw + j * D, src, D * sizeof(uint16_t));
  }
  for (int64_t d = 0; d < D; ++d)
    for (int64_t k = 0; k < P2; ++k)
      vt[d * P2 + k] = static_cast<uint32_t>(vraw[2 * k * D + d]) | (static_cast<uint32_t>(vraw[(2 * k + 1) * D + d]) << 16);
}

// V^T spans of every sequence with more than one item per KV head, packed once for all of
// them (in parallel): span sp of (seq, kvh) at a.vt_shared[a.vt_off[seq * KVH + kvh] + sp * D * 16]
// (spans before the sequence's window are not packed), a.vt_off kNoSharedVt for the others.
static void pack_shared_vt(Args& a, const c10::BFloat16* pool, int64_t S, int64_t rows_per_item,
                           std::vector<uint32_t>& buf, std::vector<int64_t>& off) {
  constexpr int64_t P2 = kSpan / 2;
  off.assign(S * a.KVH, kNoSharedVt);
  std::vector<std::array<int64_t, 3>> tasks;  // (seq, kvh, span)
  int64_t size = 0;
  for (int64_t sq = 0; sq < S; ++sq) {
    const int64_t ql = a.qstart[sq + 1] - a.qstart[sq], total = a.ctx[sq] + ql;
    if (ql * a.G <= rows_per_item) continue;  // one item per KV head: it packs its own
    // from the span of the first key the sequence's first new row sees (its window's start)
    const int64_t sp0 = a.window > 0 ? std::max<int64_t>(0, a.ctx[sq] - a.window + 1) / kSpan : 0;
    const int64_t sp1 = (total + kSpan - 1) / kSpan;
    for (int64_t g = 0; g < a.KVH; ++g) {
      off[sq * a.KVH + g] = size - sp0 * a.D * P2;  // span sp is at off + sp * D * 16
      for (int64_t sp = sp0; sp < sp1; ++sp) tasks.push_back({sq, g, sp});
      size += (sp1 - sp0) * a.D * P2;
    }
  }
  if (tasks.empty()) return;
  buf.resize(size);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 16, [&](int64_t b, int64_t e) {
    std::vector<uint16_t> vraw(kSpan * a.D);
    for (int64_t i = b; i < e; ++i) {
      const auto& [sq, g, sp] = tasks[i];
      pack_vt_span(a, pool, sq, g, sp, buf.data() + off[sq * a.KVH + g] + sp * a.D * P2, vraw.data());
    }
  });
  a.vt_shared = buf.data();
  a.vt_off = off.data();
}

static void run_item_amx(const Args& a, const Item& it, const c10::BFloat16* q, const c10::BFloat16* pool,
                         c10::BFloat16* out, Scratch& s) {
  constexpr int64_t P2 = kSpan / 2;      // key pairs per span
  const int64_t D = a.D, G = a.G, BS = a.BS, W = a.window;
  const int64_t D2 = D / 2, nd = D / L;  // dim pairs per row; O^T tiles
  const int64_t nres = std::min<int64_t>(nd, 4);  // O^T tiles kept in registers; the rest go through memory
  const ItemGeom g(a, it);
  const int64_t qs = g.qs, nrows = g.nrows, ntiles = g.ntiles;
  const int64_t* table = g.table;
  s.qt2.assign(ntiles * D2 * L, 0u);
  s.ot.resize(D * L);
  s.p.resize(kSpan * L);
  s.vraw.resize(kSpan * D);

  // Q^T pairs per micro-tile (unscaled, as in qk_tile_pairs)
  item_rows(a, it, g, q, s, [&](int64_t t, int64_t lane, const c10::BFloat16* qr) {
    uint32_t* dst2 = s.qt2.data() + t * D2 * L + lane;
    for (int64_t k = 0; k < D2; ++k) std::memcpy(dst2 + k * L, qr + 2 * k, sizeof(uint32_t));
  });
  const int64_t first = s.tmin[0], last = s.tmax[ntiles - 1];
  const int64_t k_lo = W > 0 ? std::max<int64_t>(0, first - W + 1) : 0;
  const int64_t sp_lo = k_lo / kSpan, sp_hi = last / kSpan, nsp = sp_hi - sp_lo + 1;

  // V^T pairs of every span the item visits, [nsp][D][16 key pairs]; V past the sequence reads as 0
  // (a sequence split into several items per KV head has them packed once per call: a.vt_shared)
  const int64_t shared_off = a.vt_off != nullptr ? a.vt_off[it.seq * a.KVH + it.kvh] : kNoSharedVt;
  const uint32_t* vt_buf;  // span sp at vt_buf[vt_off + sp * D * 16]
  int64_t vt_off;
  if (shared_off != kNoSharedVt) {
    vt_buf = a.vt_shared;
    vt_off = shared_off;
  } else {
    s.vp.resize(nsp * D * P2);
    for (int64_t sp = sp_lo; sp <= sp_hi; ++sp)
      pack_vt_span(a, pool, it.seq, it.kvh, sp, s.vp.data() + (sp - sp_lo) * D * P2, s.vraw.data());
    vt_buf = s.vp.data();
    vt_off = -sp_lo * D * P2;
  }

  float* pb = s.p.data();  // S^T of the span [32 keys][16 rows]
  float* ot = s.ot.data();
  alignas(64) uint32_t pp[P2 * L];
  const __m512 qmul = _mm512_set1_ps(a.qmul);
  const bool qpos = !(a.qmul < 0.f);
  // word w of the interleaved pairs comes from word w / 2 of p0 (even w) or of p1 (odd w)
  const __m512i kPairIdx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                            21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const int64_t k_stride = a.p_st * static_cast<int64_t>(sizeof(uint16_t));  // bytes between keys
  for (int64_t t = 0; t < ntiles; ++t) {
    const int64_t tmin = s.tmin[t], tmax = s.tmax[t];
    const int64_t nvalid = std::min<int64_t>(L, nrows - t * L);
    const uint32_t* qt2 = s.qt2.data() + t * D2 * L;
    __m512 m_run = _mm512_set1_ps(kNegInf), l_run = _mm512_setzero_ps();
    _tile_zero(4);
    if (nd > 1) _tile_zero(5);
    if (nd > 2) _tile_zero(6);
    if (nd > 3) _tile_zero(7);
    std::fill(ot + nres * L * L, ot + D * L, 0.f);  // O^T past the register tiles
    const __m512 rp = _mm512_loadu_ps(s.pos.data() + t * L);
    const __m512 rl = _mm512_loadu_ps(s.lo.data() + t * L);
    for (int64_t sp = sp_lo; sp <= sp_hi; ++sp) {
      const int64_t kbase = sp * kSpan, kend = kbase + kSpan - 1;
      if (kbase > tmax) break;                        // this and later spans: all in every row's future
      if (W > 0 && kend <= tmin - W) continue;        // all keys before every row's window
      const bool masked = kend > tmin || (W > 0 && kbase <= tmax - W);
      const bool second = kbase + L <= tmax;          // the second 16 keys are not all in the future
      // S^T = K . Q^T per 16 keys, 32 dims per product; K straight from the pool (16 keys lie
      // in one block and before the sequence's end)
      const c10::BFloat16* k0 = pool + table[kbase / BS] * a.p_sb + it.kvh * a.p_sh + (kbase % BS) * a.p_st;
      const c10::BFloat16* k1 = second ? pool + table[(kbase + L) / BS] * a.p_sb + it.kvh * a.p_sh +
                                             ((kbase + L) % BS) * a.p_st : k0;
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t ch = 0; ch < D2; ch += L) {
        _tile_loadd(1, qt2 + ch * L, L * 4);
        _tile_loadd(0, k0 + 2 * ch, k_stride);
        _tile_dpbf16ps(2, 0, 1);
        if (second) {
          _tile_loadd(0, k1 + 2 * ch, k_stride);
          _tile_dpbf16ps(3, 0, 1);
        }
      }
      _tile_stored(2, pb, L * 4);
      _tile_stored(3, pb + L * L, L * 4);
      // the span's largest raw score per row (masked keys at -inf); its scaled value is the
      // largest scaled score, as rounding q * s is monotone in s (qmul > 0; < 0: the smallest)
      __mmask16 valid[kSpan];
      __m512 s_ext = _mm512_set1_ps(qpos ? kNegInf : -kNegInf);
      for (int64_t j = 0; j < kSpan; ++j) {
        __m512 x = _mm512_loadu_ps(pb + j * L);
        if (masked) {
          const __m512 kp = _mm512_set1_ps(static_cast<float>(kbase + j));
          valid[j] = _mm512_cmp_ps_mask(kp, rp, _CMP_LE_OQ) & _mm512_cmp_ps_mask(kp, rl, _CMP_GT_OQ);
          x = _mm512_mask_mov_ps(s_ext, valid[j], x);
        }
        s_ext = qpos ? _mm512_max_ps(s_ext, x) : _mm512_min_ps(s_ext, x);
      }
      const __m512 m_tile = _mm512_max_ps(m_run, _mm512_mul_ps(s_ext, qmul));
      const __mmask16 grow = _mm512_cmp_ps_mask(m_tile, _mm512_add_ps(m_run, _mm512_set1_ps(kLazyMax)), _CMP_GT_OQ);
      const __m512 m_new = _mm512_mask_mov_ps(m_run, grow, m_tile);
      const __m512 m_safe = _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ),
                                               _mm512_setzero_ps());
      __m512 sum = _mm512_setzero_ps();
      for (int64_t k = 0; k < P2; ++k) {
        // 2^(q s - m), q s rounded before m is subtracted, as m was taken: the span's largest
        // argument is then exactly m_tile - m_new <= kLazyMax. (A fused q s - m is off by up to
        // half an ulp of m, over 127 once |m| > 2^31: p inf or 0, a NaN row.) The series is cut
        // at degree 5 (truncation error < 3e-6, a thousandth of the bfloat16 step p is rounded to next)
        __m512 p0 = vexp2<5>({_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(pb + 2 * k * L), qmul), m_safe)}).v;
        __m512 p1 = vexp2<5>({_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(pb + (2 * k + 1) * L), qmul), m_safe)}).v;
        if (masked) {
          p0 = _mm512_maskz_mov_ps(valid[2 * k], p0);
          p1 = _mm512_maskz_mov_ps(valid[2 * k + 1], p1);
        }
        // P rounded to bfloat16 (both rows of a key pair at once), interleaved into the pairs
        // the tile product reads: dword i = (p0[i], p1[i]); the row sums add the rounded values
        const __m512i pair = _mm512_permutexvar_epi16(kPairIdx, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)));
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32(int(0xffff0000u)))));
        _mm512_store_si512(pp + k * L, pair);
      }
      if (grow) {  // some row's max moved: its l and O^T scale by 2^(m_old - m_new)
        const __m512 alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), grow, vexp2({_mm512_sub_ps(m_run, m_safe)}).v);
        l_run = _mm512_mul_ps(l_run, alpha);
        o_store(ot, nres);
        for (int64_t d = 0; d < D; ++d) _mm512_storeu_ps(ot + d * L, _mm512_mul_ps(_mm512_loadu_ps(ot + d * L), alpha));
        o_load(ot, nres);
      }
      l_run = _mm512_add_ps(l_run, sum);
      m_run = m_new;
      // O^T += V^T . P^T, 16 dims per product
      const uint32_t* vt = vt_buf + (vt_off + sp * D * P2);
      _tile_loadd(1, pp, L * 4);
      _tile_loadd(2, vt, P2 * 4);
      _tile_dpbf16ps(4, 2, 1);
      if (nd > 1) { _tile_loadd(3, vt + 1 * L * P2, P2 * 4); _tile_dpbf16ps(5, 3, 1); }
      if (nd > 2) { _tile_loadd(0, vt + 2 * L * P2, P2 * 4); _tile_dpbf16ps(6, 0, 1); }
      if (nd > 3) { _tile_loadd(2, vt + 3 * L * P2, P2 * 4); _tile_dpbf16ps(7, 2, 1); }
      for (int64_t dc = 4; dc < nd; dc += 2) {  // head_dim > 64: two O^T tiles at a time through memory
        float* o0 = ot + dc * L * L;
        _tile_loadd(2, o0, L * 4);
        _tile_loadd(0, vt + dc * L * P2, P2 * 4);
        _tile_dpbf16ps(2, 0, 1);
        if (dc + 1 < nd) {
          _tile_loadd(3, o0 + L * L, L * 4);
          _tile_loadd(0, vt + (dc + 1) * L * P2, P2 * 4);
          _tile_dpbf16ps(3, 0, 1);
          _tile_stored(3, o0 + L * L, L * 4);
        }
        _tile_stored(2, o0, L * 4);
      }
    }
    o_store(ot, nres);
    // out = O / l, rounded to bfloat16 (nearest even), 16 dims of a row at a time
    float inv[L];
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l_run));
    const __m512i col = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(L));
    for (int64_t lane = 0; lane < nvalid; ++lane) {
      const int64_t rr = it.r0 + t * L + lane;
      c10::BFloat16* dst = out + (qs + rr / G) * a.o_s0 + (it.kvh * G + rr % G) * a.o_s1;
      const __m512 iv = _mm512_set1_ps(inv[lane]);
      for (int64_t d0 = 0; d0 < D; d0 += L) {
        const __m512 o = _mm512_mul_ps(_mm512_i32gather_ps(col, ot + d0 * L + lane, 4), iv);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d0), bf16_bits(o));
      }
    }
  }
}
constexpr bool kHaveAmx = true;
#else
static bool amx_granted() { return false; }
static void amx_configure() {}
static void run_item_amx(const Args&, const Item&, const c10::BFloat16*, const c10::BFloat16*, c10::BFloat16*,
                         Scratch&) {}
static void pack_shared_vt(Args&, const c10::BFloat16*, int64_t, int64_t, std::vector<uint32_t>&,
                           std::vector<int64_t>&) {}
constexpr bool kHaveAmx = false;
#endif

// Whether supported bfloat16 calls take the AMX path now (built, granted, allowed).
bool amx_active() { return kHaveAmx && g_amx_wanted.load() && amx_granted(); }

// Whether a bfloat16 call with this head_dim and block size takes the AMX path now: the one
// rule, used by paged_attention and reported to the worker's start line.
bool amx_serves(int64_t head_dim, int64_t block_size) {
  return head_dim % 32 == 0 && head_dim <= 256 && block_size % L == 0 && amx_active();
}

template <typename QT, typename KT>
static void run_all(const Args& a, const std::vector<std::vector<Item>>& lists, const QT* q, const KT* pool, QT* out) {
  at::parallel_for(0, static_cast<int64_t>(lists.size()), 1, [&](int64_t b, int64_t e) {
    Scratch s;
    if constexpr (std::is_same_v<QT, c10::BFloat16> && std::is_same_v<KT, c10::BFloat16>) {
      if (a.amx) {
        amx_configure();  // the tile configuration is per thread, and oneDNN sets its own
        for (int64_t w = b; w < e; ++w)
          for (const Item& it : lists[w]) run_item_amx(a, it, q, pool, out, s);
#ifdef KVMESH_AMX
        _tile_release();
#endif
        return;
      }
    }
    for (int64_t w = b; w < e; ++w)
      for (const Item& it : lists[w]) run_item<QT, KT>(a, it, q, pool, out, s);
  });
}

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& kv_cache, int64_t layer_idx,
                           const at::Tensor& query_start_in, const at::Tensor& context_lens_in,
                           const at::Tensor& block_tables_in, int64_t block_size, int64_t window, double scale) {
  TORCH_CHECK(q_in.device().is_cpu() && kv_cache.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q_in.dim() == 3, "paged_attention: q must be [T, H, D]");
  TORCH_CHECK(kv_cache.dim() == 6, "paged_attention: kv_cache must be [blocks, layers, 2, kv_heads, block_size, D]");
  const auto qdt = q_in.scalar_type(), kdt = kv_cache.scalar_type();
  TORCH_CHECK(qdt == at::kFloat || qdt == at::kBFloat16, "paged_attention: q must be float32 or bfloat16");
  TORCH_CHECK(kdt == at::kFloat || kdt == at::kBFloat16, "paged_attention: kv_cache must be float32 or bfloat16");
  const int64_t T = q_in.size(0), H = q_in.size(1), D = q_in.size(2);
  const int64_t KVH = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == block_size, "paged_attention: block_size differs from kv_cache.size(4)");
  TORCH_CHECK(kv_cache.size(5) == D, "paged_attention: head_dim of q and kv_cache differ");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "paged_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(layer_idx >= 0 && layer_idx < kv_cache.size(1), "paged_attention: layer_idx out of range");
  TORCH_CHECK(kv_cache.stride(5) == 1, "paged_attention: kv_cache must be contiguous in head_dim");
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor qstart = query_start_in.to(at::kLong).contiguous();
  const at::Tensor ctx = context_lens_in.to(at::kLong).contiguous();
  const at::Tensor tables = block_tables_in.to(at::kLong).contiguous();
  const int64_t S = ctx.numel();
  TORCH_CHECK(qstart.numel() == S + 1, "paged_attention: query_start must have one entry per sequence plus one");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == S, "paged_attention: block_tables must be [S, max_blocks]");
  at::Tensor out = at::empty({T, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (T == 0 || S == 0) return out;

  Args a;
  a.D = D; a.H = H; a.KVH = KVH; a.G = H / KVH; a.BS = block_size; a.window = window;
  a.qmul = static_cast<float>(scale * 1.4426950408889634);
  a.amx = qdt == at::kBFloat16 && kdt == at::kBFloat16 && amx_serves(D, block_size);
  a.qstart = qstart.data_ptr<int64_t>();
  a.ctx = ctx.data_ptr<int64_t>();
  a.tables = tables.data_ptr<int64_t>();
  a.table_stride = tables.size(1);
  a.q_s0 = q.stride(0); a.q_s1 = q.stride(1);
  a.p_sb = kv_cache.stride(0); a.p_skv = kv_cache.stride(2); a.p_sh = kv_cache.stride(3); a.p_st = kv_cache.stride(4);
  a.o_s0 = out.stride(0); a.o_s1 = out.stride(1);
  TORCH_CHECK(a.qstart[0] == 0 && a.qstart[S] == T, "paged_attention: query_start must run from 0 to T");
  const int64_t num_blocks = kv_cache.size(0);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t ql = a.qstart[s + 1] - a.qstart[s];
    TORCH_CHECK(ql >= 1 && a.ctx[s] >= 0, "paged_attention: bad query/context length");
    const int64_t need = (a.ctx[s] + ql + block_size - 1) / block_size;
    TORCH_CHECK(need <= a.table_stride, "paged_attention: block table too short");
    for (int64_t b = 0; b < need; ++b) {
      const int64_t id = a.tables[s * a.table_stride + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_attention: block id out of range");
    }
  }

  // Work items: (sequence, kv head, chunk of rows); cost ~ rows x keys visited.
  constexpr int64_t kChunkRows = 16 * L;
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t ql = a.qstart[s + 1] - a.qstart[s], c = a.ctx[s];
    const int64_t rows = ql * a.G;
    for (int64_t r0 = 0; r0 < rows; r0 += kChunkRows) {
      const int64_t r1 = std::min(rows, r0 + kChunkRows);
      const double pos_mid = static_cast<double>(c) + 0.5 * static_cast<double>(r0 + r1 - 1) / a.G;
      const double keys = window > 0 ? std::min<double>(pos_mid + 1, window + L) : pos_mid + 1;
      for (int64_t g = 0; g < KVH; ++g)
        items.push_back({s, g, r0, r1, (static_cast<double>((r1 - r0 + L - 1) / L) * L) * (keys + L)});
    }
  }
  // Longest-processing-time-first assignment, one list per thread.
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size())));
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  std::vector<std::vector<Item>> lists(nt);
  std::vector<double> load(nt, 0.0);
  for (const Item& it : items) {
    const int64_t w = std::min_element(load.begin(), load.end()) - load.begin();
    lists[w].push_back(it);
    load[w] += it.cost;
  }

  const at::Tensor layer = kv_cache.select(1, layer_idx);  // [blocks, 2, kv_heads, block_size, D]
  std::vector<uint32_t> vt_buf;
  std::vector<int64_t> vt_off;
  if (a.amx) pack_shared_vt(a, layer.data_ptr<c10::BFloat16>(), S, kChunkRows, vt_buf, vt_off);
  if (qdt == at::kFloat && kdt == at::kFloat)
    run_all<float, float>(a, lists, q.data_ptr<float>(), layer.data_ptr<float>(), out.data_ptr<float>());
  else if (qdt == at::kFloat && kdt == at::kBFloat16)
    run_all<float, c10::BFloat16>(a, lists, q.data_ptr<float>(), layer.data_ptr<c10::BFloat16>(), out.data_ptr<float>());
  else if (qdt == at::kBFloat16 && kdt == at::kFloat)
    run_all<c10::BFloat16, float>(a, lists, q.data_ptr<c10::BFloat16>(), layer.data_ptr<float>(), out.data_ptr<c10::BFloat16>());
  else
    run_all<c10::BFloat16, c10::BFloat16>(a, lists, q.data_ptr<c10::BFloat16>(), layer.data_ptr<c10::BFloat16>(),
                                          out.data_ptr<c10::BFloat16>());
  return out;
}

bool built_with_avx2() {  // the AVX2 + FMA steps (taken only where AVX-512 is not available)
#ifdef KVMESH_AVX2
  return true;
#else
  return false;
#endif
}

bool built_with_avx512() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}


// ---------------------------------------------------------------------------------------
// Fused element-wise ops of a bfloat16 forward (one pass each instead of 3-6 torch ops and
// their temporaries). RMSNorm rounds exactly as the torch ops it replaces (same result,
// bit for bit); RoPE computes x * cos + rot * sin in fp32 and rounds once (torch's bf16 ops
// round x * cos first).

static inline V load_bf16(const c10::BFloat16* p) {
  float f[L];
  bf16_to_f32_16(p, f);
  return vload(f);
}
static inline void store_bf16(c10::BFloat16* p, V x) {
#ifdef __AVX512F__
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(x.v));  // nearest even
#else
  float f[L];
  vstore(f, x);
  for (int i = 0; i < L; ++i) p[i] = c10::BFloat16(f[i]);  // round to nearest even
#endif
}
// x rounded to bfloat16, kept in fp32
static inline V vround_bf16(V x) {
  c10::BFloat16 b[L];
  store_bf16(b, x);
  return load_bf16(b);
}

// One row of RMSNorm (Zhang & Sennrich 2019), HF Llama order: orow = w * bf16(xr / sqrt(mean(xr^2) + eps)),
// H values.
static void rms_row(const c10::BFloat16* xr, const c10::BFloat16* wp, c10::BFloat16* orow, int64_t H, double eps) {
  V acc = vzero();
  int64_t i = 0;
  for (; i + L <= H; i += L) { const V v = load_bf16(xr + i); acc = vfma(v, v, acc); }
  float f[L];
  vstore(f, acc);
  double ss = 0.0;
  for (int k = 0; k < L; ++k) ss += f[k];
  for (; i < H; ++i) { const float v = static_cast<float>(xr[i]); ss += static_cast<double>(v) * v; }
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(H) + eps));
  i = 0;
#ifdef __AVX512F__
  for (; i + L <= H; i += L)  // the same two roundings, 16 at a time
    store_bf16(orow + i, vmul(load_bf16(wp + i), vround_bf16(vmul(load_bf16(xr + i), vset1(inv)))));
#endif
  for (; i < H; ++i) {
    const float nrm = static_cast<float>(c10::BFloat16(static_cast<float>(xr[i]) * inv));
    orow[i] = c10::BFloat16(static_cast<float>(wp[i]) * nrm);
  }
}

// Error text for a number or a tensor's dtype and shape ("BFloat16 [33, 5]"), made with
// snprintf. Messages here never stream numbers: std::ostream's number output, instantiated in
// this library from the compiler's headers, crashed (SIGSEGV in basic_ostream::_M_insert<long>)
// in a process that had loaded an older libstdc++ than those headers (g++ 13.3 against
// torch 2.11's Python image on an H200 host). Streaming plain strings works there.
struct Text {
  char s[192];
};

static Text num_text(int64_t v) {
  Text t;
  std::snprintf(t.s, sizeof t.s, "%lld", static_cast<long long>(v));
  return t;
}

static Text tensor_text(const at::Tensor& x) {
  Text t;
  int n = std::snprintf(t.s, sizeof t.s, "%s [", c10::toString(x.scalar_type()));
  for (int64_t d = 0; d < x.dim() && n > 0 && n < static_cast<int>(sizeof t.s); ++d)
    n += std::snprintf(t.s + n, sizeof t.s - n, d ? ", %lld" : "%lld", static_cast<long long>(x.size(d)));
  if (n > 0 && n < static_cast<int>(sizeof t.s)) std::snprintf(t.s + n, sizeof t.s - n, "]");
  return t;
}

static void check_norm_args(const char* op, const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, op, ": bf16 only");
  TORCH_CHECK(x.dim() >= 1 && w.numel() == x.size(-1), op, ": weight size differs from the last dim");
}

at::Tensor rms_norm_bf16(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  check_norm_args("rms_norm_bf16", x_in, w_in);
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t H = x.size(-1), rows = x.numel() / std::max<int64_t>(H, 1);
  at::Tensor out = at::empty_like(x);
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = w.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rms_row(xp + r * H, wp, op + r * H, H, eps);
  });
  return out;
}

// A residual add and the next RMSNorm in one pass: (s, rms_norm_bf16(s, w, eps)) with
// s = bf16(x + y), torch's bf16 add; the same values as the two ops, bit for bit.
std::tuple<at::Tensor, at::Tensor> add_rms_norm_bf16(const at::Tensor& x_in, const at::Tensor& y_in,
                                                     const at::Tensor& w_in, double eps) {
  check_norm_args("add_rms_norm_bf16", x_in, w_in);
  TORCH_CHECK(y_in.scalar_type() == at::kBFloat16 && y_in.sizes() == x_in.sizes(),
              "add_rms_norm_bf16: y must be bf16 of x's shape ", tensor_text(x_in).s, ", got ",
              tensor_text(y_in).s);
  const at::Tensor x = x_in.contiguous(), y = y_in.contiguous(), w = w_in.contiguous();
  const int64_t H = x.size(-1), rows = x.numel() / std::max<int64_t>(H, 1);
  at::Tensor sum = at::empty_like(x, x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor out = at::empty_like(sum);
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* yp = y.data_ptr<c10::BFloat16>();
  const auto* wp = w.data_ptr<c10::BFloat16>();
  auto* sp = sum.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const c10::BFloat16* xr = xp + r * H;
      const c10::BFloat16* yr = yp + r * H;
      c10::BFloat16* sr = sp + r * H;
      int64_t i = 0;
      for (; i + L <= H; i += L) store_bf16(sr + i, vadd(load_bf16(xr + i), load_bf16(yr + i)));
      for (; i < H; ++i) sr[i] = c10::BFloat16(static_cast<float>(xr[i]) + static_cast<float>(yr[i]));
      rms_row(sr, wp, op + r * H, H, eps);
    }
  });
  return {sum, out};
}

// SwiGLU's activation (Shazeer 2020) over the fused gate/up product: gu [T, 2I] bf16 (rows
// contiguous, gate then up) -> [T, I] = bf16(bf16(silu(gate)) * up), the two roundings of
// torch's bf16 silu_ then mul_; silu(g) = g / (1 + e^-g) in fp32 (e^-g from vexp2).
at::Tensor silu_mul_bf16(const at::Tensor& gu_in) {
  TORCH_CHECK(gu_in.scalar_type() == at::kBFloat16 && gu_in.dim() == 2 && gu_in.size(1) % 2 == 0,
              "silu_mul_bf16: gu must be bf16 [T, 2I], got ", tensor_text(gu_in).s);
  const at::Tensor gu = gu_in.stride(1) == 1 ? gu_in : gu_in.contiguous();
  const int64_t T = gu.size(0), I = gu.size(1) / 2, s0 = gu.stride(0);
  at::Tensor out = at::empty({T, I}, gu.options().memory_format(at::MemoryFormat::Contiguous));
  if (T == 0 || I == 0) return out;
  const auto* gp = gu.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  constexpr float kLog2e = 1.4426950408889634f;
  at::parallel_for(0, T, 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const c10::BFloat16* g = gp + r * s0;
      const c10::BFloat16* u = g + I;
      c10::BFloat16* o = op + r * I;
      int64_t i = 0;
      for (; i + L <= I; i += L) {
        const V x = load_bf16(g + i);
        // e^-g = 2^-t, t = g log2(e) clamped at -128 so that 2^-t is at most 2^128 = inf (every
        // scalef variant gets that right); NaN stays NaN, -inf gives NaN as in torch
        const V t = vmax(vset1(-128.f), vmul(x, vset1(kLog2e)));
        const V act = vround_bf16(vdiv(x, vadd(vset1(1.f), vexp2(vsub(vzero(), t)))));
        store_bf16(o + i, vmul(act, load_bf16(u + i)));
      }
      for (; i < I; ++i) {
        const float x = static_cast<float>(g[i]);
        const float act = static_cast<float>(c10::BFloat16(x / (1.f + std::exp2(-std::max(-128.f, x * kLog2e)))));
        o[i] = c10::BFloat16(act * static_cast<float>(u[i]));
      }
    }
  });
  return out;
}

// RoPE (Su et al. 2021), rotate-half convention (HF Llama), in place on x [T, heads, D]
// (last dim contiguous) with cos, sin [T, D] (bf16): x = x * cos + [-x2, x1] * sin.
void rope_bf16_(at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3 && x.stride(2) == 1,
              "rope_bf16_: x must be bf16 [T, heads, D] with the last dim contiguous");
  TORCH_CHECK(at::has_internal_overlap(x) != at::MemOverlap::Yes,
              "rope_bf16_: x has elements that share memory (e.g. an expanded tensor); pass a real tensor");
  const int64_t T = x.size(0), NH = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "rope_bf16_: head_dim must be even for rotate-half RoPE, got ", num_text(D).s);
  for (const at::Tensor* t : {&cos_in, &sin_in})
    TORCH_CHECK((t->dim() == 2 || (t->dim() == 3 && t->size(1) == 1)) && t->size(0) == T && t->size(-1) == D,
                "rope_bf16_: cos and sin must be [T, D] or [T, 1, D] with T = ", num_text(T).s, " and D = ",
                num_text(D).s, ", got ", tensor_text(*t).s);
  if (T == 0 || NH == 0) return;
  const at::Tensor c = cos_in.reshape({T, D}).contiguous();
  const at::Tensor sn = sin_in.reshape({T, D}).contiguous();
  TORCH_CHECK(c.scalar_type() == at::kBFloat16 && sn.scalar_type() == at::kBFloat16, "rope_bf16_: bf16 cos/sin");
  auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* cp = c.data_ptr<c10::BFloat16>();
  const auto* sp = sn.data_ptr<c10::BFloat16>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
    std::vector<float> a(D);
    for (int64_t t = b; t < e; ++t) {
      const c10::BFloat16* ct = cp + t * D;
      const c10::BFloat16* st = sp + t * D;
      for (int64_t h = 0; h < NH; ++h) {
        c10::BFloat16* row = xp + t * s0 + h * s1;
        for (int64_t d = 0; d < D; ++d) a[d] = static_cast<float>(row[d]);
        for (int64_t d = 0; d < half; ++d) {
          row[d] = c10::BFloat16(a[d] * static_cast<float>(ct[d]) - a[d + half] * static_cast<float>(st[d]));
          row[d + half] = c10::BFloat16(a[d + half] * static_cast<float>(ct[d + half]) +
                                        a[d] * static_cast<float>(st[d + half]));
        }
      }
    }
  });
}

bool built_with_avx512_bf16() { return kHavePairs; }

bool built_with_amx() { return kHaveAmx; }

// Allow (true) or forbid (false) the AMX path for later calls; returns whether bfloat16 calls
// it supports (head_dim a multiple of 32 up to 256, block_size % 16 == 0) will now take it: built with AMX,
// granted the tile state by the OS, and allowed.
bool set_amx(bool on) {
  g_amx_wanted.store(on);
  return amx_active();
}

}  // namespace kvmesh_attn

TORCH_LIBRARY(kvmesh, m) {
  m.def("paged_attention(Tensor q, Tensor kv_cache, int layer_idx, Tensor query_start, Tensor context_lens, "
        "Tensor block_tables, int block_size, int window, float scale) -> Tensor");
  m.def("built_with_avx512", &kvmesh_attn::built_with_avx512);
  m.def("built_with_avx2", &kvmesh_attn::built_with_avx2);
  m.def("built_with_avx512_bf16", &kvmesh_attn::built_with_avx512_bf16);
  m.def("built_with_amx", &kvmesh_attn::built_with_amx);
  m.def("set_amx", &kvmesh_attn::set_amx);
  m.def("amx_active", &kvmesh_attn::amx_active);
  m.def("amx_serves", &kvmesh_attn::amx_serves);
  m.def("rms_norm_bf16(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_bf16(Tensor x, Tensor y, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope_bf16_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul_bf16(Tensor gu) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("paged_attention", &kvmesh_attn::paged_attention);
  m.impl("rms_norm_bf16", &kvmesh_attn::rms_norm_bf16);
  m.impl("add_rms_norm_bf16", &kvmesh_attn::add_rms_norm_bf16);
  m.impl("rope_bf16_", &kvmesh_attn::rope_bf16_);
  m.impl("silu_mul_bf16", &kvmesh_attn::silu_mul_bf16);
}
