// Group-quantized matrix products on the CPU (AVX2, FMA, F16C; with float activations also an
// AVX-512 path, chosen at run time where the CPU has it), and bfloat16-weight products.
//
//   out[m, n] = sum_k a[m, k] * w[n, k],   w[n, k] = u[n, k] * scale[n, g] + zero[n, g],
//   g = k / group_size, scale and zero float16 [N, groups]
//
// int4: u in [0, 15], two per byte; byte 16 c + j of a row holds u[32 c + j] in its low nibble
// and u[32 c + 16 + j] in its high one (GGUF's Q4_0/Q4_1 order). int8: u in [-128, 127], one
// per byte. The offset term is sum_g zero[n, g] * (the float sum of group g of a's row): the
// AVX-512 tiles add it to each output's lanes before summing them (a row's scales and offsets
// are read in order beside its weights), the AVX2 ones in a pass of their own.
//
// Activations either stay float32 (each 32-input chunk's products summed in float32, then
// scaled), or are rounded to int16 (int4 and int8 weights: tile_int16 on AVX-512 VNNI,
// tile_int16_avx2 elsewhere) or int8 (llama.cpp's rounding: u8 x s8 pairs summed to int16, pairs
// of those to int32, exact) with one scale per 32 inputs (AVX2's int16 tile: one scale per row)
// and multiplied in integers. int8 weights whose offsets are all 0 (Q8_0) come with zero
// [N, 0]: no offset term and no group sums.
// The offsets always see the float sums. Every output is computed by the same instructions in
// the same order whatever the number of rows m, so a row's result does not depend on the rows
// beside it.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

constexpr int kRows = 4;  // activation rows per pass over a weight row

struct Args {
  const float* a;       // [M, K] float32 activations
  const int8_t* qa;     // [M, K] int8 activations, or null
  const float* da;      // [M, K / 32] their scales
  int64_t M, K, N, group;
  const uint8_t* w;     // [N, K / 2] (int4) or [N, K] (int8)
  const at::Half* scale;  // [N, K / group]
  float* out;           // [M, N]
  const float* asum;    // [M, groups] float sums of each group of a's row (null without offsets)
  const at::Half* zero; // [N, groups], or null: every offset 0 (pack stores int8's so)
  const int16_t* qw;    // int16 activations, [M, K / 64, 2, 32] (VNNI) or [M, K] (AVX2), or null
  const float* dw;      // [M, K / 64, 16] their scales, as each pair's lanes need them (VNNI), or
                        // [M], one a row, with qw [M, K] in input order (AVX2: tile_int16_avx2)
  bool vnni = false;    // which of the two int16 layouts qw and dw hold
};

// The 32 weights of chunk c of one row as four vectors of 8 floats.
template <int Bits>
inline void chunk_float(const uint8_t* row, int64_t c, __m256 w[4]) {
  if constexpr (Bits == 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 16));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  } else {
    const uint8_t* p = row + c * 32;
    for (int i = 0; i < 4; ++i) {
      const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i));
      w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    }
  }
}

// Rows m0 .. m0 + R of output row n, float activations (R fixed: accumulators in registers).
template <int Bits, int R>
inline void tile_float(const Args& p, int64_t m0, int64_t n) {
  const int64_t K = p.K, per = p.group / 32, groups = K / p.group;
  const uint8_t* wn = p.w + n * (Bits == 4 ? K / 2 : K);
  const at::Half* sn = p.scale + n * groups;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 s = _mm256_set1_ps(_cvtsh_ss(sn[g].x));
    for (int64_t c = g * per; c < (g + 1) * per; ++c) {
      __m256 wv[4];
      chunk_float<Bits>(wn, c, wv);
      for (int r = 0; r < R; ++r) {
        const float* ar = p.a + (m0 + r) * K + c * 32;
        const __m256 t0 = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(ar + 8), _mm256_mul_ps(wv[0], _mm256_loadu_ps(ar)));
        const __m256 t1 = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(ar + 24), _mm256_mul_ps(wv[2], _mm256_loadu_ps(ar + 16)));
        acc[r] = _mm256_fmadd_ps(s, _mm256_add_ps(t0, t1), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) p.out[(m0 + r) * p.N + n] = hsum(acc[r]);
}

// The 32 weights of chunk c as bytes for maddubs: int4 as u (unsigned), int8 as |w| with the
// sign kept apart (to move onto the activations).
template <int Bits>
inline __m256i chunk_bytes(const uint8_t* row, int64_t c, __m256i* sign) {
  if constexpr (Bits == 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 16));
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
  } else {
    *sign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 32));
    return _mm256_sign_epi8(*sign, *sign);
  }
}

// Rows m0 .. m0 + R of output rows n and n + 1, int8 activations.
template <int Bits, int R>
inline void tile_int8(const Args& p, int64_t m0, int64_t n) {
  const int64_t K = p.K, per = p.group / 32, groups = K / p.group, chunks = K / 32;
  const int64_t row_bytes = Bits == 4 ? K / 2 : K;
  const uint8_t* w0 = p.w + n * row_bytes;
  const uint8_t* w1 = w0 + row_bytes;
  const at::Half* s0 = p.scale + n * groups;
  const at::Half* s1 = s0 + groups;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m256i sign0, sign1;
    const __m256i b0 = chunk_bytes<Bits>(w0, c, &sign0);
    const __m256i b1 = chunk_bytes<Bits>(w1, c, &sign1);
    const int64_t g = per == 1 ? c : c / per;
    const float sc0 = _cvtsh_ss(s0[g].x), sc1 = _cvtsh_ss(s1[g].x);
    for (int r = 0; r < R; ++r) {
      const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.qa + (m0 + r) * K + c * 32));
      const float d = p.da[(m0 + r) * chunks + c];
      __m256i a0 = av, a1 = av;
      if constexpr (Bits == 8) {
        a0 = _mm256_sign_epi8(av, sign0);
        a1 = _mm256_sign_epi8(av, sign1);
      }
      const __m256i i0 = _mm256_madd_epi16(_mm256_maddubs_epi16(b0, a0), ones);
      const __m256i i1 = _mm256_madd_epi16(_mm256_maddubs_epi16(b1, a1), ones);
      acc[r][0] = _mm256_fmadd_ps(_mm256_set1_ps(sc0 * d), _mm256_cvtepi32_ps(i0), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_set1_ps(sc1 * d), _mm256_cvtepi32_ps(i1), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    p.out[(m0 + r) * p.N + n] = hsum(acc[r][0]);
    p.out[(m0 + r) * p.N + n + 1] = hsum(acc[r][1]);
  }
}

// --- AVX-512 (runtime-dispatched; the file is compiled for AVX2) ---------------------------------
// Each 32-input chunk of a weight row becomes two vectors of 16 floats: an int4 row's bytes widen
// to 16 int32 lanes and a 16-entry table of 0.0 .. 15.0 is indexed by each lane's low nibble,
// then by its high one (vpermps reads the low 4 bits of each index), 5 instructions for 32
// weights against 13 in the AVX2 path. The output rows of a tile share every activation load.

#define MTPLX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

template <int Bits>
MTPLX_AVX512 inline void chunk_float512(const uint8_t* row, int64_t c, __m512 iota, __m512 w[2]) {
  if constexpr (Bits == 4) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 16)));
    w[0] = _mm512_permutexvar_ps(b, iota);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), iota);
  } else {
    const __m128i* q = reinterpret_cast<const __m128i*>(row + c * 32);
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
  }
}

// The first n of 16 lanes (all 16 from n = 16 on): a masked load's tail of groups.
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
}

// The scales and offsets of output rows n .. n + O, which a tile further on reads: their own
// streams beside the weights', fetched ahead like the weights (every cache line of each row).
// Without this the tiles waited on them: 30 layers' products of one token row, one thread,
// 4.36 -> 2.89 ms in the int16 tile (with its division per pair counted away, below); the float
// tiles 5.24 -> 4.67 ms, and 4.8 -> 4.35 with their weights too fetched four tiles ahead, not one.
template <int O>
__attribute__((always_inline)) inline void prefetch_scales(const Args& p, int64_t n) {
  const int64_t groups = p.K / p.group;
  for (int o = 0; o < O; ++o) {
    const int64_t row = (n + o) * groups;
    // 32 float16 values a cache line, and the row's last value (its lines need not be aligned)
    for (int64_t g = 0; g < groups; g += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(p.scale + row + g), _MM_HINT_T0);
      if (p.zero) _mm_prefetch(reinterpret_cast<const char*>(p.zero + row + g), _MM_HINT_T0);
    }
    _mm_prefetch(reinterpret_cast<const char*>(p.scale + row + groups - 1), _MM_HINT_T0);
    if (p.zero) _mm_prefetch(reinterpret_cast<const char*>(p.zero + row + groups - 1), _MM_HINT_T0);
  }
}

// The offset term of rows m0 .. m0 + R and output rows n .. n + O added to their accumulators'
// lanes: zero[n + o, g] * asum[m, g], 16 groups at a time (nothing without offsets).
template <int R, int O>
MTPLX_AVX512 __attribute__((always_inline)) inline void fold_offsets512(const Args& p, int64_t m0, int64_t n, __m512 acc[O][R]) {
  if (!p.zero) return;
  const int64_t groups = p.K / p.group;
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 live = first_lanes(groups - g);
    __m512 s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_maskz_loadu_ps(live, p.asum + (m0 + r) * groups + g);
    for (int o = 0; o < O; ++o) {
      const __m512 z = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, p.zero + (n + o) * groups + g));
      for (int r = 0; r < R; ++r) acc[o][r] = _mm512_fmadd_ps(z, s[r], acc[o][r]);
    }
  }
}

// A quantized tile's end: the offset term folded in, each output's lanes summed into out.
template <int R, int O>
MTPLX_AVX512 __attribute__((always_inline)) inline void store_tile512(const Args& p, int64_t m0, int64_t n,
                                                                       __m512 acc[O][R]) {
  fold_offsets512<R, O>(p, m0, n, acc);
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) p.out[(m0 + r) * p.N + n + o] = _mm512_reduce_add_ps(acc[o][r]);
}

// Rows m0 .. m0 + R of output rows n .. n + O, float activations: per group, each row's products
// summed in 16 lanes, then scaled into the row's accumulator. O output rows at a time share each
// activation load and keep O x R accumulator chains in flight.
template <int Bits, int R, int O>
MTPLX_AVX512 inline void tile_float512(const Args& p, int64_t m0, int64_t n) {
  const int64_t K = p.K, per = p.group / 32, groups = K / p.group;
  const int64_t row_bytes = Bits == 4 ? K / 2 : K;
  const __m512 iota = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f,
                                     14.f, 15.f);
  __m512 acc[O][R];
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) acc[o][r] = _mm512_setzero_ps();
  prefetch_scales<O>(p, n + 4 * O);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 t[O][R];
    for (int o = 0; o < O; ++o)
      for (int r = 0; r < R; ++r) t[o][r] = _mm512_setzero_ps();
    for (int64_t c = g * per; c < (g + 1) * per; ++c) {
      __m512 x[R][2];
      for (int r = 0; r < R; ++r) {
        const float* ar = p.a + (m0 + r) * K + c * 32;
        x[r][0] = _mm512_loadu_ps(ar);
        x[r][1] = _mm512_loadu_ps(ar + 16);
      }
      if ((c & (Bits == 4 ? 3 : 1)) == 0)  // each cache line of the rows four tiles on
        for (int o = 0; o < O; ++o)
          _mm_prefetch(reinterpret_cast<const char*>(p.w + (n + 4 * O + o) * row_bytes + c * (Bits == 4 ? 16 : 32)),
                       _MM_HINT_T0);
      for (int o = 0; o < O; ++o) {
        __m512 u[2];
        chunk_float512<Bits>(p.w + (n + o) * row_bytes, c, iota, u);
        for (int r = 0; r < R; ++r) t[o][r] = _mm512_fmadd_ps(u[1], x[r][1], _mm512_fmadd_ps(u[0], x[r][0], t[o][r]));
      }
    }
    for (int o = 0; o < O; ++o) {
      const __m512 sc = _mm512_set1_ps(_cvtsh_ss(p.scale[(n + o) * groups + g].x));
      for (int r = 0; r < R; ++r) acc[o][r] = _mm512_fmadd_ps(sc, t[o][r], acc[o][r]);
    }
  }
  store_tile512<R, O>(p, m0, n, acc);
}

// Every row of the tile is computed by the same instructions in the same order whatever R and O
// are, so the number of rows in a forward changes no row's result.
// One or two rows (a decode step, a depth-1 verify): four output rows a tile; more (deeper
// verifies): up to four token rows a tile over two output rows, so that a weight is unpacked
// once per four token rows.
template <int Bits>
MTPLX_AVX512 void rows_range512(const Args& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (p.M <= 2) {
    for (; n + 4 <= n1; n += 4) {
      if (p.M == 2) tile_float512<Bits, 2, 4>(p, 0, n); else tile_float512<Bits, 1, 4>(p, 0, n);
    }
  }
  for (; n < n1; n += 2) {
    int64_t m0 = 0;
    for (; m0 + 4 <= p.M; m0 += 4) tile_float512<Bits, 4, 2>(p, m0, n);
    switch (p.M - m0) {
      case 3: tile_float512<Bits, 3, 2>(p, m0, n); break;
      case 2: tile_float512<Bits, 2, 2>(p, m0, n); break;
      case 1: tile_float512<Bits, 1, 2>(p, m0, n); break;
      default: break;
    }
  }
}

// --- int16 activations, AVX-512 VNNI (runtime-dispatched) ---------------------------------------
// For int4 and int8 weights with groups of 32 or of a multiple of 64. Each 32 inputs of a row are
// rounded to int16 with one scale (max |a| / 32767; greedy output of the default model then matches
// float32 activations': docs/performance.md), and the products run in integers: 64 weights
// (two 32-input chunks, A and B, 32 bytes) widen to 32 words, the low nibbles [A 0..15, B 0..15]
// and the high ones [A 16..31, B 16..31], each multiplied by the row's words laid out the same
// way (vpdpwssd: pairs of int16 products summed into int32 lanes, exact), so lanes 0-7 hold
// chunk A's sums and 8-15 chunk B's. Those lanes become float and are scaled by the weight's
// and the activations' scales of their chunk into the row's accumulator: per 64 weights, 3
// instructions to unpack, 2 products per token row and 3 to scale, where the float path takes
// 8 and 4 and 4. int8 weights (Q8_0, the default model's output matrix) widen the same way from
// two 32-byte loads (6 instructions per 64 against the float path's 8, with the same savings in
// the products and the scaling: the output matrix at one row 1.17 -> 0.65 ms, one thread).
// Offsets (Q4_1's zero) still see the float group sums (fold_offsets512).

#define MTPLX_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))

// The 64 weights of pair q of one row as tile_int16's two vectors of 32 words: int4, the low
// nibbles of its 32 bytes and the high ones (the bytes hold chunk A's and B's in that order
// already); int8, [A 0..15, B 0..15] and [A 16..31, B 16..31], sign-extended.
template <int Bits>
MTPLX_VNNI __attribute__((always_inline)) inline void pair_words(const uint8_t* row, int64_t q, __m512i& lo,
                                                                  __m512i& hi) {
  if constexpr (Bits == 4) {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + q * 32)));
    lo = _mm512_and_si512(b, _mm512_set1_epi16(0x0F));
    hi = _mm512_srli_epi16(b, 4);
  } else {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + q * 64));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + q * 64 + 32));
    lo = _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(a, b, 0x20));
    hi = _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(a, b, 0x31));
  }
}

// Rows m0 .. m0 + R of output rows n .. n + O.
template <int Bits, int R, int O>
MTPLX_VNNI inline void tile_int16(const Args& p, int64_t m0, int64_t n) {
  const int64_t K = p.K, pairs = K / 64, groups = K / p.group, row_bytes = Bits == 4 ? K / 2 : K;
  const __m512i upper = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc[O][R], window[O];
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) acc[o][r] = _mm512_setzero_ps();
  prefetch_scales<O>(p, n + 4 * O);
  // chunk A of pair q is in group ga, chunk B in gb: 2q and 2q + 1 in groups of 32, else both
  // q / (group / 64), counted rather than divided (a division per pair cost more than its products)
  const int64_t pairs_per_group = p.group == 32 ? 0 : p.group / 64;
  int64_t ga = 0, gb = pairs_per_group ? 0 : 1, left = pairs_per_group;
  int64_t first = -16;  // the first group of each output row's 16 scales in ``window``
  for (int64_t q = 0; q < pairs; ++q) {
    if (q) {
      if (!pairs_per_group) {
        ga += 2;
        gb += 2;
      } else if (--left == 0) {
        ga = ++gb;
        left = pairs_per_group;
      }
    }
    if (gb >= first + 16) {  // the next 16 groups' scales (fewer at the end)
      first = ga;
      const __mmask16 live = first_lanes(groups - first);
      for (int o = 0; o < O; ++o)
        window[o] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, p.scale + (n + o) * groups + first));
    }
    // lane i takes scale ga (lanes 0-7) or gb (8-15) from the window
    const __m512i pick = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(ga - first)),
                                          gb != ga ? upper : _mm512_setzero_si512());
    if (Bits == 8 || (q & 1) == 0)  // each cache line of the rows four tiles on
      for (int o = 0; o < O; ++o)
        _mm_prefetch(reinterpret_cast<const char*>(p.w + (n + 4 * O + o) * row_bytes + q * (Bits == 4 ? 32 : 64)),
                     _MM_HINT_T0);
    for (int o = 0; o < O; ++o) {
      __m512i lo, hi;
      pair_words<Bits>(p.w + (n + o) * row_bytes, q, lo, hi);
      const __m512 ws = _mm512_permutexvar_ps(pick, window[o]);
      for (int r = 0; r < R; ++r) {
        const int16_t* x = p.qw + ((m0 + r) * pairs + q) * 64;
        __m512i s = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x));
        s = _mm512_dpwssd_epi32(s, hi, _mm512_loadu_si512(x + 32));
        const __m512 d = _mm512_loadu_ps(p.dw + ((m0 + r) * pairs + q) * 16);
        acc[o][r] = _mm512_fmadd_ps(_mm512_mul_ps(ws, d), _mm512_cvtepi32_ps(s), acc[o][r]);
      }
    }
  }
  store_tile512<R, O>(p, m0, n, acc);
}

// Up to four token rows: four output rows a tile; more: four token rows at a time over two
// output rows (four output rows at three and four token rows: gate/up 1.03x -> 1.25x the float
// path's speed at 2 threads, o 1.02x -> 0.94x).
template <int Bits>
MTPLX_VNNI void rows_range_int16(const Args& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (p.M <= 4) {
    for (; n + 4 <= n1; n += 4) {
      switch (p.M) {
        case 4: tile_int16<Bits, 4, 4>(p, 0, n); break;
        case 3: tile_int16<Bits, 3, 4>(p, 0, n); break;
        case 2: tile_int16<Bits, 2, 4>(p, 0, n); break;
        default: tile_int16<Bits, 1, 4>(p, 0, n); break;
      }
    }
  }
  for (; n < n1; n += 2) {
    int64_t m0 = 0;
    for (; m0 + 4 <= p.M; m0 += 4) tile_int16<Bits, 4, 2>(p, m0, n);
    switch (p.M - m0) {
      case 3: tile_int16<Bits, 3, 2>(p, m0, n); break;
      case 2: tile_int16<Bits, 2, 2>(p, m0, n); break;
      case 1: tile_int16<Bits, 1, 2>(p, m0, n); break;
      default: break;
    }
  }
}

// The int16 rounding of the inputs that share a scale (a 32-input chunk for the VNNI tile, a row
// for AVX2's) from their largest magnitude (NaN where an input is not finite): q = round((a up)
// inv), d = amax / 32767. Inputs all below 2^-60 are scaled up by 2^60 first, so that 32767 /
// max stays finite; all-zero inputs get inv 0. Both quantizers' rule.
struct ChunkScale {
  float up, inv, d;
};
__attribute__((always_inline)) inline ChunkScale chunk_scale(float amax) {
  const float up = amax > 0.f && amax < 0x1p-60f ? 0x1p60f : 1.f;
  return {up, amax > 0.f ? 32767.f / (amax * up) : 0.f, amax / 32767.f};
}

// Each 32 inputs of a row as int16 with one scale d = max |a| / 32767 (q = round(a * 32767 /
// max |a|), to nearest even, in float32: (a 2^60) (32767 / (max 2^60)) below max 2^-60; 0 where
// the 32 are all 0; d NaN where one is not finite, so that the outputs are NaN as float32
// activations would make them), laid out for tile_int16: per 64 inputs
// (chunks A, B) the words [A 0..15, B 0..15, A 16..31, B 16..31] and 16 floats [d_A x 8, d_B x 8].
MTPLX_VNNI void quantize_rows_int16(const float* a, int64_t M, int64_t K, int16_t* qw, float* dw) {
  const int64_t pairs = K / 64;
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t q = 0; q < pairs; ++q) {
      int16_t* out = qw + (m * pairs + q) * 64;
      float* ds = dw + (m * pairs + q) * 16;
      for (int h = 0; h < 2; ++h) {  // chunk A (h 0), then B
        const float* x = a + m * K + q * 64 + h * 32;
        const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(x0, magnitude),
                                                        _mm512_and_ps(x1, magnitude)));
        if (!std::isfinite(_mm512_reduce_add_ps(_mm512_add_ps(x0, x1)))) amax = NAN;  // outputs NaN, as floats'
        const ChunkScale cs = chunk_scale(amax);
        const __m512 iv = _mm512_set1_ps(cs.inv), uv = _mm512_set1_ps(cs.up);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * h),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(x0, uv), iv))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 + 16 * h),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(x1, uv), iv))));
        _mm256_storeu_ps(ds + 8 * h, _mm256_set1_ps(cs.d));
      }
    }
  }
}

int detect_isa() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") ? 512 : 256;
}

bool detect_vnni() { return detect_isa() == 512 && __builtin_cpu_supports("avx512vnni"); }

int& isa_in_use() {
  static int isa = detect_isa();
  return isa;
}

// out[m, n0:n1] += sum_g asum[m, g] * zero[n, g] (the AVX2 tiles' offsets): each output's
// offsets eight groups at a time, the lanes summed in a fixed order, a tail of fewer groups after.
void add_offsets(const Args& p, int64_t n0, int64_t n1) {
  if (!p.zero) return;
  const int64_t groups = p.K / p.group, full = groups / 8 * 8;
  for (int64_t m = 0; m < p.M; ++m) {
    const float* s = p.asum + m * groups;
    for (int64_t n = n0; n < n1; ++n) {
      const at::Half* z = p.zero + n * groups;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t g = 0; g < full; g += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z + g))),
                              _mm256_loadu_ps(s + g), acc);
      float t = hsum(acc);
      for (int64_t g = full; g < groups; ++g) t = std::fma(s[g], _cvtsh_ss(z[g].x), t);
      p.out[m * p.N + n] += t;
    }
  }
}

// --- int16 activations, AVX2 (CPUs without AVX-512 VNNI) ----------------------------------------
// Each row is rounded to int16 with one scale for the whole row (max |a| / 32767; the VNNI path
// takes one per 32 inputs), and the integer sums are exact as there, with vpmaddwd (pairs of
// int16 products summed into int32 lanes) and an add where VNNI fuses the two: a 32-input chunk's
// 16 bytes widen to 16 words, the low nibbles (inputs 0-15) and the high ones (16-31), each
// multiplied by the row's 16 words of those inputs; the 8 int32 lanes become float and are
// scaled by the weight's scale of the chunk into the row's accumulator, and the sum by the row's
// scale at the end. Per 32 int4 weights: 3 instructions to unpack and 5 per token row (one per
// chunk fewer than a scale per 32 inputs would take: the multiply of the two scales; the float
// path, tile_float, takes 11 and 7 plus 4 loads). Measured on the default model's activations
// (docs/performance.md, session 35) the row's scale keeps the products' error far below int8's
// of llama.cpp (scale per 32 inputs). The activations lie in input order here.

// The 32 weights of chunk c of one row as 16 words each of inputs 0-15 (lo) and 16-31 (hi).
template <int Bits>
__attribute__((always_inline)) inline void chunk_words(const uint8_t* row, int64_t c, __m256i& lo, __m256i& hi) {
  if constexpr (Bits == 4) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 16)));
    lo = _mm256_and_si256(b, _mm256_set1_epi16(0x0F));
    hi = _mm256_srli_epi16(b, 4);
  } else {
    const __m128i* q = reinterpret_cast<const __m128i*>(row + c * 32);
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(q));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(q + 1));
  }
}

// Rows m0 .. m0 + R of output rows n .. n + O (the offsets are added after, by add_offsets).
template <int Bits, int R, int O>
inline void tile_int16_avx2(const Args& p, int64_t m0, int64_t n) {
  const int64_t K = p.K, per = p.group / 32, groups = K / p.group;
  const int64_t row_bytes = Bits == 4 ? K / 2 : K;
  __m256 acc[O][R];
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) acc[o][r] = _mm256_setzero_ps();
  prefetch_scales<O>(p, n + 4 * O);
  for (int64_t g = 0, c = 0; g < groups; ++g) {
    __m256 sc[O];
    for (int o = 0; o < O; ++o) sc[o] = _mm256_set1_ps(_cvtsh_ss(p.scale[(n + o) * groups + g].x));
    for (const int64_t end = c + per; c < end; ++c) {
      if ((c & (Bits == 4 ? 3 : 1)) == 0)  // each cache line of the rows four tiles on
        for (int o = 0; o < O; ++o)
          _mm_prefetch(reinterpret_cast<const char*>(p.w + (n + 4 * O + o) * row_bytes + c * (Bits == 4 ? 16 : 32)),
                       _MM_HINT_T0);
      for (int o = 0; o < O; ++o) {
        __m256i lo, hi;
        chunk_words<Bits>(p.w + (n + o) * row_bytes, c, lo, hi);
        for (int r = 0; r < R; ++r) {
          const __m256i* x = reinterpret_cast<const __m256i*>(p.qw + (m0 + r) * K + c * 32);
          const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(x)),
                                             _mm256_madd_epi16(hi, _mm256_loadu_si256(x + 1)));
          acc[o][r] = _mm256_fmadd_ps(sc[o], _mm256_cvtepi32_ps(s), acc[o][r]);
        }
      }
    }
  }
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) p.out[(m0 + r) * p.N + n + o] = hsum(acc[o][r]) * p.dw[m0 + r];
}

// One or two token rows: four output rows a tile; more: up to four token rows over two output rows.
template <int Bits>
void rows_range_int16_avx2(const Args& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (p.M <= 2) {
    for (; n + 4 <= n1; n += 4) {
      if (p.M == 2) tile_int16_avx2<Bits, 2, 4>(p, 0, n); else tile_int16_avx2<Bits, 1, 4>(p, 0, n);
    }
  }
  for (; n < n1; n += 2) {
    int64_t m0 = 0;
    for (; m0 + 4 <= p.M; m0 += 4) tile_int16_avx2<Bits, 4, 2>(p, m0, n);
    switch (p.M - m0) {
      case 3: tile_int16_avx2<Bits, 3, 2>(p, m0, n); break;
      case 2: tile_int16_avx2<Bits, 2, 2>(p, m0, n); break;
      case 1: tile_int16_avx2<Bits, 1, 2>(p, m0, n); break;
      default: break;
    }
  }
  add_offsets(p, n0, n1);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Each row as int16 with one scale (chunk_scale's rule, from the row's largest magnitude), in
// input order: qw [M, K], dw [M].
void quantize_rows_int16_avx2(const float* a, int64_t M, int64_t K, int16_t* qw, float* dw) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 inf = _mm256_set1_ps(INFINITY);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = a + m * K;
    __m256 big = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      const __m256 v = _mm256_and_ps(_mm256_loadu_ps(row + k), magnitude);
      big = _mm256_max_ps(big, v);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, inf, _CMP_NLT_UQ));  // |a| = inf, or NaN
    }
    float amax = hmax(big);
    if (_mm256_movemask_ps(bad)) amax = NAN;  // outputs NaN, as float32 activations' would be
    const ChunkScale cs = chunk_scale(amax);
    const __m256 iv = _mm256_set1_ps(cs.inv), uv = _mm256_set1_ps(cs.up);
    for (int64_t i = 0; i < K / 32; ++i) {
      const float* x = row + 32 * i;
      __m256i q[4];
      for (int j = 0; j < 4; ++j)
        q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), uv), iv));
      // packs interleaves the 128-bit halves: [0-3, 8-11, 4-7, 12-15] back to input order
      int16_t* out = qw + m * K + 32 * i;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8));
    }
    dw[m] = cs.d;
  }
}

template <int Bits>
void rows_range(const Args& p, int64_t n0, int64_t n1) {
  if (p.qw) return p.vnni ? rows_range_int16<Bits>(p, n0, n1) : rows_range_int16_avx2<Bits>(p, n0, n1);
  if (!p.qa && isa_in_use() == 512) return rows_range512<Bits>(p, n0, n1);
  const int64_t step = p.qa ? 2 : 1;
  for (int64_t n = n0; n < n1; n += step) {
    int64_t m0 = 0;
    for (; m0 + kRows <= p.M; m0 += kRows) {
      if (p.qa) tile_int8<Bits, kRows>(p, m0, n); else tile_float<Bits, kRows>(p, m0, n);
    }
    switch (p.M - m0) {
      case 3: if (p.qa) tile_int8<Bits, 3>(p, m0, n); else tile_float<Bits, 3>(p, m0, n); break;
      case 2: if (p.qa) tile_int8<Bits, 2>(p, m0, n); else tile_float<Bits, 2>(p, m0, n); break;
      case 1: if (p.qa) tile_int8<Bits, 1>(p, m0, n); else tile_float<Bits, 1>(p, m0, n); break;
      default: break;
    }
  }
  add_offsets(p, n0, n1);
}

// Each 32 inputs of a row as int8 with one float scale: q = round(a / d), d = max |a| / 127.
void quantize_rows(const float* a, int64_t M, int64_t K, int8_t* qa, float* da) {
  for (int64_t i = 0; i < M * K / 32; ++i) {
    const float* x = a + 32 * i;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.f;
    da[i] = d;
    for (int j = 0; j < 32; ++j) qa[32 * i + j] = d > 0.f ? static_cast<int8_t>(std::nearbyint(x[j] / d)) : 0;
  }
}

// Whether a layout's offsets are stored: zero [N, groups], or [N, 0] where every offset is 0.
bool has_offsets(const torch::Tensor& zero, int64_t N, int64_t groups) {
  const bool offsets = zero.size(1) != 0;
  TORCH_CHECK(zero.size(0) == N && (!offsets || zero.size(1) == groups),
              "zero: [N, K / group], or [N, 0] where every offset is 0");
  return offsets;
}

}  // namespace

// Whether int16 activations apply to this product: int4 or int8 weights in groups of 32 or of a
// multiple of 64, K a multiple of 64 (on AVX-512 VNNI tile_int16, else tile_int16_avx2).
bool int16_applies(int64_t bits, int64_t group, int64_t K) {
  return (bits == 4 || bits == 8) && K % 64 == 0 && (group == 32 || group % 64 == 0);
}

// Whether int16 activations run on tile_int16 (AVX-512 VNNI, the 512-bit width in use), else on
// tile_int16_avx2.
bool int16_vnni() {
  static const bool vnni = detect_vnni();
  return vnni && isa_in_use() == 512;
}

// Whether this CPU has AVX-512 VNNI (what int16 activations need).
bool quant_has_vnni() { return detect_vnni(); }

// The vector width the float-activation products use: 512 where the CPU has AVX-512 (F, BW, VL,
// DQ), else 256 (AVX2); ``quant_isa(256)`` forces AVX2 (tests, benchmarks; int16 activations
// then run on tile_int16_avx2), 512 is refused where the CPU lacks it. Returns the width now in use.
int64_t quant_isa(int64_t want) {
  if (want == 512) TORCH_CHECK(detect_isa() == 512, "this CPU has no AVX-512 (F, BW, VL, DQ)");
  TORCH_CHECK(want == 0 || want == 256 || want == 512, "isa: 256 or 512 (0 reads it)");
  if (want) isa_in_use() = static_cast<int>(want);
  return isa_in_use();
}

torch::Tensor quant_matmul(torch::Tensor a, torch::Tensor w, torch::Tensor scale, torch::Tensor zero,
                           int64_t group, int64_t bits, int64_t activations) {
  TORCH_CHECK(activations == 32 || activations == 16 || activations == 8, "activations: 32, 16 or 8 bits");
  TORCH_CHECK(a.dim() == 2 && a.scalar_type() == torch::kFloat32, "a: [M, K] float32");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 || w.scalar_type() == torch::kInt8, "w: uint8 or int8");
  TORCH_CHECK(bits == 4 || bits == 8, "bits: 4 or 8");
  TORCH_CHECK(scale.scalar_type() == torch::kHalf && zero.scalar_type() == torch::kHalf,
              "scale, zero: float16");
  a = a.contiguous();
  const int64_t M = a.size(0), K = a.size(1), N = w.size(0), groups = group > 0 ? K / group : 0;
  TORCH_CHECK(K % 32 == 0 && group > 0 && group % 32 == 0 && K % group == 0, "K and group: multiples of 32");
  if (M == 0) return torch::empty({0, N}, a.options());
  TORCH_CHECK(w.size(1) == (bits == 4 ? K / 2 : K), "w: [N, K / 2] for int4, [N, K] for int8");
  TORCH_CHECK(scale.size(0) == N && scale.size(1) == groups, "scale: [N, K / group]");
  const bool offsets = has_offsets(zero, N, groups);
  TORCH_CHECK(N % 2 == 0, "an even number of output rows (pack pads an odd one)");
  TORCH_CHECK(w.is_contiguous() && scale.is_contiguous() && zero.is_contiguous(), "contiguous weights");
  torch::Tensor asum = torch::empty({M, offsets ? groups : 0}, a.options());
  if (offsets) {
    const float* ap = a.data_ptr<float>();
    float* sp = asum.data_ptr<float>();
    for (int64_t i = 0; i < M * groups; ++i) {
      float t = 0.f;
      for (int64_t j = 0; j < group; ++j) t += ap[i * group + j];
      sp[i] = t;
    }
  }
  torch::Tensor out = torch::empty({M, N}, a.options());
  torch::Tensor qa, da, qw, dw;
  Args p{a.data_ptr<float>(), nullptr, nullptr, M, K, N, group,
         static_cast<const uint8_t*>(w.data_ptr()), scale.data_ptr<at::Half>(), out.data_ptr<float>()};
  if (activations == 16 && int16_applies(bits, group, K)) {
    p.vnni = int16_vnni();
    qw = torch::empty({M, K}, a.options().dtype(torch::kShort));
    if (p.vnni) {
      dw = torch::empty({M, K / 64, 16}, a.options());
      quantize_rows_int16(p.a, M, K, qw.data_ptr<int16_t>(), dw.data_ptr<float>());
    } else {
      dw = torch::empty({M}, a.options());
      quantize_rows_int16_avx2(p.a, M, K, qw.data_ptr<int16_t>(), dw.data_ptr<float>());
    }
    p.qw = qw.data_ptr<int16_t>();
    p.dw = dw.data_ptr<float>();
  } else if (activations == 8) {
    qa = torch::empty({M, K}, a.options().dtype(torch::kInt8));
    da = torch::empty({M, K / 32}, a.options());
    quantize_rows(p.a, M, K, qa.data_ptr<int8_t>(), da.data_ptr<float>());
    p.qa = qa.data_ptr<int8_t>();
    p.da = da.data_ptr<float>();
  }
  p.asum = offsets ? asum.data_ptr<float>() : nullptr;
  p.zero = offsets ? zero.data_ptr<at::Half>() : nullptr;
  // about 32 k multiply-adds per task at least, so that small matrices stay on one thread;
  // tasks start at even rows (int8 activations take output rows in pairs)
  const int64_t grain = std::max<int64_t>(2, 32768 / std::max<int64_t>(1, K * M));
  at::parallel_for(0, N / 2, grain / 2, [&](int64_t h0, int64_t h1) {
    const int64_t n0 = 2 * h0, n1 = 2 * h1;
    if (bits == 4) rows_range<4>(p, n0, n1); else rows_range<8>(p, n0, n1);
  });
  return out;
}


// The float32 weight [N, K] these integers, scales and offsets stand for (u * scale + zero), for
// products of many rows (prefill), which then run as one float32 matrix product.
torch::Tensor quant_dequantize(torch::Tensor w, torch::Tensor scale, torch::Tensor zero, int64_t group,
                               int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits: 4 or 8");
  TORCH_CHECK(scale.scalar_type() == torch::kHalf && zero.scalar_type() == torch::kHalf, "scale, zero: float16");
  TORCH_CHECK(w.is_contiguous() && scale.is_contiguous() && zero.is_contiguous(), "contiguous weights");
  TORCH_CHECK(group > 0 && group % 32 == 0, "group: a multiple of 32");
  const int64_t N = w.size(0), K = bits == 4 ? w.size(1) * 2 : w.size(1);
  TORCH_CHECK(K % group == 0, "K: a multiple of group");
  const int64_t groups = K / group;
  TORCH_CHECK(scale.size(0) == N && scale.size(1) == groups, "scale: [N, K / group]");
  const bool offsets = has_offsets(zero, N, groups);
  torch::Tensor out = torch::empty({N, K}, scale.options().dtype(torch::kFloat32));
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const at::Half* sp = scale.data_ptr<at::Half>();
  const at::Half* zp = offsets ? zero.data_ptr<at::Half>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      float* o = op + n * K;
      const uint8_t* row = wp + n * (bits == 4 ? K / 2 : K);
      for (int64_t c = 0; c < K / 32; ++c) {  // 32 inputs at a time, u * scale + zero in 8 lanes
        const int64_t g = c * 32 / group;
        const __m256 s = _mm256_set1_ps(_cvtsh_ss(sp[n * groups + g].x));
        const __m256 z = _mm256_set1_ps(zp ? _cvtsh_ss(zp[n * groups + g].x) : 0.f);
        __m256 w[4];
        if (bits == 4) chunk_float<4>(row, c, w); else chunk_float<8>(row, c, w);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + c * 32 + 8 * i, _mm256_fmadd_ps(w[i], s, z));
      }
    }
  });
  return out;
}


// --- dense weights (bfloat16, float16, float32), float32 activations -------------------------------
// out[m, n] = sum_k a[m, k] * w[n, k] with w stored as bfloat16 (an MTP head trained and shipped in
// bf16: the same weights as its float32 copy at half the bytes), float16 (a checkpoint's float16
// output matrix, widened exactly) or float32. Each weight is widened to float32 on load (bf16: a
// shift; float16: vcvtph2ps); products and sums in float32, each row on its own, whatever M.

namespace {

enum class Dense { BF16, F16, F32 };

template <Dense D>
MTPLX_AVX512 inline __m512 load16(const void* w, int64_t i) {
  if constexpr (D == Dense::F32) {
    return _mm512_loadu_ps(static_cast<const float*>(w) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + i));
    if constexpr (D == Dense::F16) return _mm512_cvtph_ps(h);
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <Dense D>
inline __m256 load8(const void* w, int64_t i) {
  if constexpr (D == Dense::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(w) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i));
    if constexpr (D == Dense::F16) return _mm256_cvtph_ps(h);
    else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// Where input k starts a cache line of the weight rows, that line of the rows four tiles on (a
// tile reads rows n .. n + O): the MTP head's bf16 products (10.4 MB), one token row, one
// thread, after 64 MB written elsewhere 379 -> 180 us (AVX2: 419 -> 186).
template <Dense D, int O>
__attribute__((always_inline)) inline void prefetch_dense(const void* w, int64_t K, int64_t n, int64_t k) {
  constexpr int64_t size = D == Dense::F32 ? 4 : 2;  // bytes a weight
  if ((k * size) % 64) return;
  const char* ahead = static_cast<const char*>(w) + ((n + 4 * O) * K + k) * size;
  for (int o = 0; o < O; ++o) _mm_prefetch(ahead + o * K * size, _MM_HINT_T0);
}

template <Dense D, int R, int O>
MTPLX_AVX512 inline void tile_dense_512(const float* a, const void* w, float* out, int64_t K, int64_t N,
                                        int64_t m0, int64_t n) {
  __m512 acc[O][R];
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) acc[o][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 x[R];
    for (int r = 0; r < R; ++r) x[r] = _mm512_loadu_ps(a + (m0 + r) * K + k);
    prefetch_dense<D, O>(w, K, n, k);
    for (int o = 0; o < O; ++o) {
      const __m512 u = load16<D>(w, (n + o) * K + k);
      for (int r = 0; r < R; ++r) acc[o][r] = _mm512_fmadd_ps(u, x[r], acc[o][r]);
    }
  }
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) out[(m0 + r) * N + n + o] = _mm512_reduce_add_ps(acc[o][r]);
}

template <Dense D, int O>
MTPLX_AVX512 void rows_dense_512(const float* a, const void* w, float* out, int64_t M, int64_t K, int64_t N,
                                 int64_t n) {
  int64_t m0 = 0;
  for (; m0 + 2 <= M; m0 += 2) tile_dense_512<D, 2, O>(a, w, out, K, N, m0, n);
  if (m0 < M) tile_dense_512<D, 1, O>(a, w, out, K, N, m0, n);
}

template <Dense D, int R, int O>
inline void tile_dense_256(const float* a, const void* w, float* out, int64_t K, int64_t N, int64_t m0,
                           int64_t n) {
  __m256 acc[O][R];
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) acc[o][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 x[R];
    for (int r = 0; r < R; ++r) x[r] = _mm256_loadu_ps(a + (m0 + r) * K + k);
    prefetch_dense<D, O>(w, K, n, k);
    for (int o = 0; o < O; ++o) {
      const __m256 u = load8<D>(w, (n + o) * K + k);
      for (int r = 0; r < R; ++r) acc[o][r] = _mm256_fmadd_ps(u, x[r], acc[o][r]);
    }
  }
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) out[(m0 + r) * N + n + o] = hsum(acc[o][r]);
}

template <Dense D, int O>
void rows_dense_256(const float* a, const void* w, float* out, int64_t M, int64_t K, int64_t N, int64_t n) {
  int64_t m0 = 0;
  for (; m0 + 2 <= M; m0 += 2) tile_dense_256<D, 2, O>(a, w, out, K, N, m0, n);
  if (m0 < M) tile_dense_256<D, 1, O>(a, w, out, K, N, m0, n);
}

template <Dense D>
void dense_rows(const float* ap, const void* wp, float* op, int64_t M, int64_t K, int64_t N) {
  const bool wide = isa_in_use() == 512;
  const int64_t grain = std::max<int64_t>(4, 32768 / std::max<int64_t>(1, K * M));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
      if (wide) rows_dense_512<D, 4>(ap, wp, op, M, K, N, n); else rows_dense_256<D, 4>(ap, wp, op, M, K, N, n);
    }
    for (; n < n1; ++n) {
      if (wide) rows_dense_512<D, 1>(ap, wp, op, M, K, N, n); else rows_dense_256<D, 1>(ap, wp, op, M, K, N, n);
    }
  });
}

}  // namespace

torch::Tensor dense_matmul(torch::Tensor a, torch::Tensor w) {
  TORCH_CHECK(a.dim() == 2 && a.scalar_type() == torch::kFloat32, "a: [M, K] float32");
  TORCH_CHECK(a.device().is_cpu() && w.device().is_cpu(), "a and w must be CPU tensors");
  const auto t = w.scalar_type();
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() &&
              (t == torch::kBFloat16 || t == torch::kHalf || t == torch::kFloat32),
              "w: [N, K] contiguous bfloat16, float16 or float32");
  a = a.contiguous();
  const int64_t M = a.size(0), K = a.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && K % 16 == 0, "w: [N, K] with K a multiple of 16");
  torch::Tensor out = torch::empty({M, N}, a.options());
  if (M == 0 || N == 0) return out;
  const float* ap = a.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (t == torch::kBFloat16) dense_rows<Dense::BF16>(ap, w.data_ptr(), op, M, K, N);
  else if (t == torch::kHalf) dense_rows<Dense::F16>(ap, w.data_ptr(), op, M, K, N);
  else dense_rows<Dense::F32>(ap, w.data_ptr(), op, M, K, N);
  return out;
}

torch::Tensor bf16_matmul(torch::Tensor a, torch::Tensor w) {
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "w: [N, K] bfloat16");
  return dense_matmul(a, w);
}
