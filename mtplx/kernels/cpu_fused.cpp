// A decoder layer's small steps on the CPU, one call each instead of a handful of PyTorch ops
// (on a 135M model every op's dispatch costs more than its arithmetic): the residual add with
// the RMSNorm after it, q/k norms with RoPE and the KV-cache write, one row's attention over
// its paged keys, and SiLU * up. float32; each token row is computed on its own, the same way
// whatever else is in the batch.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

int64_t quant_isa(int64_t want);  // cpu_quant.cpp: the vector width in use (0 reads it)

namespace {

// Eight elements of a pool row as float32: float32 pools as they are, float16 ones widened
// (exactly) by F16C.
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// e^x for x <= 0 (softmax after its maximum is subtracted), eight lanes: 2^n e^r with
// n = round(x log2 e), r = x - n ln 2 in two parts, e^r by its degree-6 Taylor polynomial (relative
// error about 1e-7, as std::exp's float result); below -87 the result is 0.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.f), x);  // (a NaN stays NaN: max_ps returns its second operand)
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// s[j] = e^(s[j] - top) for j < n, returning their sum (lanes summed in a fixed order).
inline float exp_shifted(float* s, int64_t n, float top) {
  const __m256 t = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), t));
    _mm256_storeu_ps(s + j, v);
    acc = _mm256_add_ps(acc, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float total = 0.f;
  for (float l : lanes) total += l;
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - top);
    total += s[j];
  }
  return total;
}

inline void norm_row(const float* x, const float* w, float eps, int64_t H, float* y) {
  float ss = 0.f;
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) y[i] = w[i] * (x[i] * r);
}

// (x + delta, rmsnorm(x + delta) * w); delta may be undefined (then x, norm(x)).
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta,
                                        torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32, "float32");
  x = x.contiguous();
  const int64_t H = x.size(-1), T = x.numel() / H;
  torch::Tensor s = x;
  if (delta.has_value() && delta->defined()) {
    const torch::Tensor d = delta->contiguous();
    TORCH_CHECK(d.sizes() == x.sizes(), "delta: x's shape");
    s = torch::empty_like(x);
    const float *xp = x.data_ptr<float>(), *dp = d.data_ptr<float>();
    float* sp = s.data_ptr<float>();
    for (int64_t i = 0; i < T * H; ++i) sp[i] = xp[i] + dp[i];
  }
  torch::Tensor y = torch::empty_like(x);
  const float *sp = s.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) norm_row(sp + t * H, wp, static_cast<float>(eps), H, yp + t * H);
  return {s, y};
}

// Rotate-half RoPE of one head vector in place over its first rd channels.
inline void rope(float* v, const float* cos, const float* sin, int64_t rd) {
  const int64_t half = rd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cos[i] - b * sin[i];
    v[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// KV pools the kernels take: both float32 or both float16, contiguous.
inline void check_pools(const torch::Tensor& k_pool, const torch::Tensor& v_pool) {
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type() &&
              (k_pool.scalar_type() == torch::kFloat32 || k_pool.scalar_type() == torch::kHalf),
              "float32 or float16 pools");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "contiguous pools");
}

// Set when a finite value became float16's inf in to_half (read and cleared by take_half_overflow).
std::atomic<bool> half_overflow{false};

// float32 -> float16 rounded to nearest (even), as torch's .half() rounds: eight at a time by
// F16C (a scalar c10::Half conversion per element made a 4,000-token prompt's writes 0.7 s slower).
// A finite value of magnitude 65,520 or more (halfway past float16's largest, 65,504) becomes inf:
// that sets half_overflow.
inline void to_half(const float* src, c10::Half* dst, int64_t n) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 big = _mm256_set1_ps(65520.f), inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 over = _mm256_setzero_ps();
  int64_t x = 0;
  for (; x + 8 <= n; x += 8) {
    const __m256 v = _mm256_loadu_ps(src + x), a = _mm256_and_ps(v, magnitude);
    over = _mm256_or_ps(over, _mm256_and_ps(_mm256_cmp_ps(a, big, _CMP_GE_OQ), _mm256_cmp_ps(a, inf, _CMP_LT_OQ)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + x), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  bool overflowed = _mm256_movemask_ps(over) != 0;
  for (; x < n; ++x) {  // (the same conversion, one at a time: a NaN keeps the same bits either way)
    const float a = std::fabs(src[x]);
    overflowed |= a >= 65520.f && a < std::numeric_limits<float>::infinity();
    dst[x] = c10::Half(_cvtss_sh(src[x], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), c10::Half::from_bits());
  }
  if (overflowed) half_overflow.store(true, std::memory_order_relaxed);
}

// qkv [T, (heads + 2 kv_heads) d] -> q [T, heads, d] with its norm and RoPE; k (norm, RoPE) and
// v written to the pools' flat slots [*, kv_heads, d]. cos, sin: [T, rd].
torch::Tensor rope_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                         torch::Tensor k_pool, torch::Tensor v_pool, int64_t heads, int64_t kv_heads,
                         int64_t d, c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
                         double eps) {
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat32, "float32 qkv");
  check_pools(k_pool, v_pool);
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  const torch::Tensor sl = slots.to(torch::kLong).contiguous();
  const int64_t width = (heads + 2 * kv_heads) * d, T = qkv.numel() / width, rd = cos.size(-1);
  TORCH_CHECK(cos.numel() == T * rd && sin.numel() == T * rd, "cos, sin: [T, rotary_dim]");
  TORCH_CHECK(sl.numel() == T, "one slot per token");
  const bool qn = q_norm.has_value() && q_norm->defined(), kn = k_norm.has_value() && k_norm->defined();
  torch::Tensor q = torch::empty({T, heads, d}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  const float* qw = qn ? q_norm->contiguous().data_ptr<float>() : nullptr;
  const float* kw = kn ? k_norm->contiguous().data_ptr<float>() : nullptr;
  const int64_t* slp = sl.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  const bool half = k_pool.scalar_type() == torch::kHalf;
  float* kp = half ? nullptr : k_pool.data_ptr<float>();
  float* vp = half ? nullptr : v_pool.data_ptr<float>();
  c10::Half* kh = half ? k_pool.data_ptr<c10::Half>() : nullptr;
  c10::Half* vh = half ? v_pool.data_ptr<c10::Half>() : nullptr;
  std::vector<float> key(static_cast<size_t>(d));  // a half pool's key before its rounding
  const int64_t slots_total = k_pool.numel() / (kv_heads * d);
  const float e = static_cast<float>(eps);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = src + t * width;
    const float *c = cp + t * rd, *s = snp + t * rd;
    for (int64_t h = 0; h < heads; ++h) {
      float* out = qp + (t * heads + h) * d;
      if (qn) norm_row(row + h * d, qw, e, d, out); else std::copy(row + h * d, row + (h + 1) * d, out);
      rope(out, c, s, rd);
    }
    const int64_t slot = slp[t];
    TORCH_CHECK(slot >= 0 && slot < slots_total, "slot out of range");
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t at = (slot * kv_heads + h) * d;
      float* kd = half ? key.data() : kp + at;
      const float* ks = row + (heads + h) * d;
      if (kn) norm_row(ks, kw, e, d, kd); else std::copy(ks, ks + d, kd);
      rope(kd, c, s, rd);
      const float* vs = row + (heads + kv_heads + h) * d;
      if (half) {
        to_half(kd, kh + at, d);
        to_half(vs, vh + at, d);
      } else {
        std::copy(vs, vs + d, vp + at);
      }
    }
  }
  return q;
}

// --- attention over spans of keys: a job per KV head and span of kSpan keys -------------------
// Each job is one KV head and one span of keys [c kSpan, (c + 1) kSpan): every query head of the
// KV head, of every query of the row (a verify's 1 + D tokens), shares each key and value row
// read (grouped-query attention: 3 query heads a KV head on the default model), and a context's
// spans run on all threads (4,000 keys are 32 spans a KV head; one row's 3 KV heads over 240 keys
// are 6 jobs, where a job per (query, KV head) gave 2 threads 3). A job leaves, per query head,
// the span's maximum score m, its sum of e^(s - m) and its e^(s - m)-weighted values; the spans
// are then merged in their order. The spans are fixed by key position, not by the batch or the
// thread count, so a query gets the same numbers alone, in a verify or in a batch. The dot
// products and the value sums run 16 lanes at a time with AVX-512 (``Wide``: a head size a
// multiple of 16), else 8 with AVX2 (``Narrow``; a head size not a multiple of 8 ends in scalar
// tails); the job itself (which keys, the softmax, the batches of sums) is ``attend_span``.

constexpr int64_t kSpan = 128;

#define MTPLX_ATTN512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

// A pool row's 16 elements from x as float32: float32 pools as they are, float16 ones widened
// (exactly) by F16C.
MTPLX_ATTN512 __attribute__((always_inline)) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
MTPLX_ATTN512 __attribute__((always_inline)) inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <typename KV>  // the pools' element: float or c10::Half
struct SpanArgs {
  const float* q;
  const KV *k, *v;
  const int64_t *table, *positions;
  int64_t heads, kv_heads, d, block, key_start, spans;
  float scale;
  float* partial;  // [Q, heads, spans, d + 2]: (m, sum, weighted values)
  float* out;      // [Q, heads * d]: where one span holds every key, the results (no merge)
};

// One span job's rows: its keys' and values' rows of the KV head (found once: no division per
// read), how many of them each query attends (seen), and the most any query does.
template <typename KV>
struct SpanRows {
  const KV* k[kSpan];
  const KV* v[kSpan];
  std::vector<int64_t> seen;
  int64_t most = 0;
};

// Lane u of the result: the sum of v[u]'s 16 lanes (pairs of lanes, then pairs of pairs within
// each 128-bit block, then the four blocks).
MTPLX_ATTN512 __attribute__((always_inline)) inline __m512 sum16(const __m512 v[16]) {
  __m512 t[8], w[4];
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p)  // per block: [v0 lanes 0+2, v1 0+2, v0 1+3, v1 1+3] of v[2p], v[2p + 1]
    t[p] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * p], v[2 * p + 1]), _mm512_unpackhi_ps(v[2 * p], v[2 * p + 1]));
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) {  // per block: the block's sums of v[4p], ..., v[4p + 3]
    const __m512d c = _mm512_castps_pd(t[2 * p]), e = _mm512_castps_pd(t[2 * p + 1]);
    w[p] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, e)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, e)));
  }
  // block p of the result: the four blocks of w[p] summed
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Lane u of the result: the sum of v[u]'s 8 lanes (pairs, then pairs of pairs within each
// 128-bit half, then the two halves).
inline __m256 sum8(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// The largest of s[0 .. n) (-inf for none), eight lanes at a time; a NaN is passed over, as
// std::max(top, s) passes it (a NaN score still makes its sums NaN).
inline float max_of(const float* s, int64_t n) {
  __m256 top8 = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) top8 = _mm256_max_ps(_mm256_loadu_ps(s + j), top8);  // (NaN lanes: the second operand)
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  float top = -INFINITY;
  for (float l : lanes) top = std::max(top, l);
  for (; j < n; ++j) top = std::max(top, s[j]);
  return top;
}

// Key rows are fetched kAhead keys ahead (a long context's cache streams from memory), and each
// block's value rows (for the pass after the scores).
constexpr int64_t kAhead = 64;

template <typename KV>
inline void fetch_rows(const KV* const* rows, int64_t from, int64_t to, int64_t d, int hint) {
  constexpr int64_t line = 64 / sizeof(KV);  // elements a cache line
  for (int64_t j = from; j < to; ++j)
    for (int64_t x = 0; x < d; x += line) {
      if (hint == 0)
        _mm_prefetch(reinterpret_cast<const char*>(rows[j] + x), _MM_HINT_T0);
      else
        _mm_prefetch(reinterpret_cast<const char*>(rows[j] + x), _MM_HINT_T1);
    }
}

// scores[(i group + g) kSpan + j] = scale q_(i, g) . k_j for query i's (query, head) pairs of
// heads g0 .. g1 and the span's keys j it sees, B keys at a time: ``block(q, kr, out)`` writes
// B scores of one (query, head), kr the B keys' rows (past the span's keys: the last one again,
// whose scores are not read), so that each key row is read once for every query head of the KV
// head (all the row's queries).
template <int B, typename KV, typename Block>
inline void span_scores(const SpanArgs<KV>& a, int64_t Q, int64_t kvh, int64_t g0, int64_t g1, const SpanRows<KV>& r,
                        float* scores, Block block) {
  const int64_t group = a.heads / a.kv_heads, d = a.d, most = r.most;
  for (int64_t j0 = 0; j0 < kAhead; j0 += B) fetch_rows(r.k, j0, std::min(most, j0 + B), d, 0);
  for (int64_t j0 = 0; j0 < most; j0 += B) {
    const int64_t n = std::min<int64_t>(B, most - j0);
    const KV* kr[B];
    for (int64_t u = 0; u < B; ++u) kr[u] = r.k[j0 + std::min(u, n - 1)];
    if (j0 + kAhead < most) fetch_rows(r.k, j0 + kAhead, std::min(most, j0 + kAhead + B), d, 0);
    fetch_rows(r.v, j0, j0 + n, d, 1);
    for (int64_t i = 0; i < Q; ++i) {
      if (j0 >= r.seen[i]) continue;
      const float* qi = a.q + (i * a.heads + kvh * group) * d;
      for (int64_t g = g0; g < g1; ++g) block(qi + g * d, kr, scores + (i * group + g) * kSpan + j0);
    }
  }
}

// AVX-512: a (query, head)'s 16 dot products in 16 accumulators, then summed across lanes
// together (sum16) rather than one horizontal sum each; with the rows found once and the value
// pass's sums in registers (weigh_values), 30 layers' attention at the default model's shapes,
// one thread, 1 / 2 queries: 500 keys 60 -> 47 / 66 -> 53 us a layer, 4,000 keys 550 -> 434 / 655
// -> 567 (benchmarks/cpu_attention.py; a long context then waits on memory).
template <typename KV>
MTPLX_ATTN512 void scores_block16(const float* q, const KV* const* kr, int64_t d, float scale, float* out) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int u = 0; u < 16; ++u) acc[u] = _mm512_setzero_ps();
  for (int64_t x = 0; x < d; x += 16) {
    const __m512 qx = _mm512_loadu_ps(q + x);
#pragma GCC unroll 16
    for (int u = 0; u < 16; ++u) acc[u] = _mm512_fmadd_ps(qx, load16(kr[u] + x), acc[u]);
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
}

// AVX2: 8 keys at a time; a head size not a multiple of 8 adds each key's tail of scalar products
// (fused, as the lanes' are) to its lane sum.
template <typename KV>
inline void scores_block8(const float* q, const KV* const* kr, int64_t d, float scale, float* out) {
  const int64_t body = d - d % 8;
  __m256 acc[8];
#pragma GCC unroll 8
  for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
  for (int64_t x = 0; x < body; x += 8) {
    const __m256 qx = _mm256_loadu_ps(q + x);
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qx, widen8(kr[u] + x), acc[u]);
  }
  __m256 s = sum8(acc);
  if (body < d) {
    alignas(32) float tail[8];
    for (int u = 0; u < 8; ++u) {
      float t = 0.f;
      for (int64_t x = body; x < d; ++x) t = std::fma(q[x], static_cast<float>(kr[u][x]), t);
      tail[u] = t;
    }
    s = _mm256_add_ps(s, _mm256_load_ps(tail));
  }
  _mm256_storeu_ps(out, _mm256_mul_ps(s, _mm256_set1_ps(scale)));
}

// The weighted values of M (query, head) sums over one span, 16 lanes of the head size at a time
// with the M sums in registers: sum u takes keys 0 .. n[u] - 1 (the sums' common keys first, then
// the few keys a verify's later queries see more), its weights at w[u], into out[u].
template <int M, typename KV>
MTPLX_ATTN512 void weigh_values(const KV* const* vrow, int64_t d, const float* const* w, const int64_t* n,
                                float* const* out) {
  int64_t all = n[0], upto = n[0];
  for (int u = 1; u < M; ++u) {
    all = std::min(all, n[u]);
    upto = std::max(upto, n[u]);
  }
  for (int64_t x = 0; x < d; x += 16) {
    __m512 acc[M];
#pragma GCC unroll 16
    for (int u = 0; u < M; ++u) acc[u] = _mm512_setzero_ps();
    for (int64_t j = 0; j < all; ++j) {
      const __m512 vv = load16(vrow[j] + x);
#pragma GCC unroll 16
      for (int u = 0; u < M; ++u) acc[u] = _mm512_fmadd_ps(_mm512_set1_ps(w[u][j]), vv, acc[u]);
    }
    for (int64_t j = all; j < upto; ++j) {
      const __m512 vv = load16(vrow[j] + x);
#pragma GCC unroll 16
      for (int u = 0; u < M; ++u)
        if (j < n[u]) acc[u] = _mm512_fmadd_ps(_mm512_set1_ps(w[u][j]), vv, acc[u]);
    }
#pragma GCC unroll 16
    for (int u = 0; u < M; ++u) _mm512_storeu_ps(out[u] + x, acc[u]);
  }
}

template <typename KV, int... Ms>
MTPLX_ATTN512 void weigh_values_of(int m, std::integer_sequence<int, Ms...>, const KV* const* vrow, int64_t d,
                                   const float* const* w, const int64_t* n, float* const* out) {
  ((m == Ms + 1 ? weigh_values<Ms + 1>(vrow, d, w, n, out) : void()), ...);
}

// The same with AVX2: C blocks of 8 lanes at a time for each of M sums (C = 8 / M blocks, so that
// a few sums still make eight independent chains of products: one sum's keys in a single chain
// waited on each product's latency), the blocks left over one at a time, then a head size's tail
// past a multiple of 8 one element at a time; each sum over its keys in order.
template <int M, int C, typename KV>
inline void weigh_blocks8(const KV* const* vrow, int64_t x, int64_t all, int64_t upto, const float* const* w,
                          const int64_t* n, float* const* out) {
  __m256 acc[M][C];
#pragma GCC unroll 8
  for (int u = 0; u < M; ++u)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[u][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < upto; ++j) {
    __m256 vv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) vv[c] = widen8(vrow[j] + x + 8 * c);
#pragma GCC unroll 8
    for (int u = 0; u < M; ++u) {
      if (j >= all && j >= n[u]) continue;  // a verify's later queries see a few keys more
      const __m256 b = _mm256_set1_ps(w[u][j]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[u][c] = _mm256_fmadd_ps(b, vv[c], acc[u][c]);
    }
  }
#pragma GCC unroll 8
  for (int u = 0; u < M; ++u)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out[u] + x + 8 * c, acc[u][c]);
}

template <int M, typename KV>
void weigh_values8(const KV* const* vrow, int64_t d, const float* const* w, const int64_t* n, float* const* out) {
  int64_t all = n[0], upto = n[0];
  for (int u = 1; u < M; ++u) {
    all = std::min(all, n[u]);
    upto = std::max(upto, n[u]);
  }
  constexpr int C = M >= 8 ? 1 : 8 / M;
  const int64_t body = d - d % 8;
  int64_t x = 0;
  for (; x + 8 * C <= body; x += 8 * C) weigh_blocks8<M, C>(vrow, x, all, upto, w, n, out);
  for (; x < body; x += 8) weigh_blocks8<M, 1>(vrow, x, all, upto, w, n, out);
  for (x = body; x < d; ++x)
    for (int u = 0; u < M; ++u) {
      float t = 0.f;
      for (int64_t j = 0; j < n[u]; ++j) t = std::fma(w[u][j], static_cast<float>(vrow[j][x]), t);
      out[u][x] = t;
    }
}

template <typename KV, int... Ms>
void weigh_values8_of(int m, std::integer_sequence<int, Ms...>, const KV* const* vrow, int64_t d,
                      const float* const* w, const int64_t* n, float* const* out) {
  ((m == Ms + 1 ? weigh_values8<Ms + 1>(vrow, d, w, n, out) : void()), ...);
}

// A span job's vector steps, W lanes at a time: its scores, and up to W of its weighted-value
// sums at once. Wide: AVX-512; Narrow: AVX2.
template <int W>
struct Lanes {
  static constexpr int kSums = W;
  template <typename KV>
  static void scores(const SpanArgs<KV>& a, int64_t Q, int64_t kvh, int64_t g0, int64_t g1, const SpanRows<KV>& r,
                     float* s) {
    span_scores<W>(a, Q, kvh, g0, g1, r, s, [&](const float* q, const KV* const* kr, float* out) {
      if constexpr (W == 16)
        scores_block16(q, kr, a.d, a.scale, out);
      else
        scores_block8(q, kr, a.d, a.scale, out);
    });
  }
  template <typename KV>
  static void weigh(int m, const KV* const* vrow, int64_t d, const float* const* w, const int64_t* n,
                    float* const* out) {
    if constexpr (W == 16)
      weigh_values_of<KV>(m, std::make_integer_sequence<int, W>{}, vrow, d, w, n, out);
    else
      weigh_values8_of<KV>(m, std::make_integer_sequence<int, W>{}, vrow, d, w, n, out);
  }
};
using Wide = Lanes<16>;
using Narrow = Lanes<8>;

// out[0 .. d) / total: an attention result's weighted values over their sum of weights (zeros
// where no key was seen, total 0; a NaN stays NaN). The spans' merge and a context of one span
// both end here, so the two give the same numbers.
inline void divide_by(float* out, int64_t d, float total) {
  if (total == 0.f) {
    std::fill(out, out + d, 0.f);
    return;
  }
  const float inv = 1.f / total;
  for (int64_t x = 0; x < d; ++x) out[x] *= inv;
}

// One job: KV head kvh's query heads g0 .. g1 (of every query) over span c's keys, into
// their partial results.
template <typename V, typename KV>
void attend_span(const SpanArgs<KV>& a, int64_t Q, int64_t kvh, int64_t g0, int64_t g1, int64_t c,
                 SpanRows<KV>& r, std::vector<float>& scores) {
  const int64_t group = a.heads / a.kv_heads, d = a.d, first = std::max(a.key_start, c * kSpan);
  auto slot = [&](int64_t i, int64_t g) {  // query i, head g of this KV head: its partial result
    return a.partial + ((i * a.heads + kvh * group + g) * a.spans + c) * (d + 2);
  };
  r.seen.resize(static_cast<size_t>(Q));  // how many of the span's keys each query attends
  r.most = 0;
  for (int64_t i = 0; i < Q; ++i) {
    r.seen[i] = std::max<int64_t>(0, std::min(a.positions[i], (c + 1) * kSpan - 1) + 1 - first);
    r.most = std::max(r.most, r.seen[i]);
  }
  for (int64_t j = 0, b = first / a.block, o = first % a.block; j < r.most; ++j) {
    const int64_t at = ((a.table[b] * a.block + o) * a.kv_heads + kvh) * d;
    r.k[j] = a.k + at;
    r.v[j] = a.v + at;
    if (++o == a.block) o = 0, ++b;
  }
  scores.resize(static_cast<size_t>(Q * group * kSpan));
  V::scores(a, Q, kvh, g0, g1, r, scores.data());
  // each (query, head): the span's maximum, e^(s - max) and their sum
  std::vector<int64_t> live;  // (query, head) pairs that see a key of the span, as i * group + g
  for (int64_t i = 0; i < Q; ++i) {
    const int64_t n = r.seen[i];
    for (int64_t g = g0; g < g1; ++g) {
      float* out = slot(i, g);
      if (n == 0) {
        out[0] = -INFINITY;
        out[1] = 0.f;
        continue;
      }
      float* sg = scores.data() + (i * group + g) * kSpan;
      const float top = max_of(sg, n);
      out[0] = top;
      out[1] = exp_shifted(sg, n, top);
      live.push_back(i * group + g);
    }
  }
  // weighted values: each value row read once for up to V::kSums (query, head) sums; one span
  // of keys in all writes the results, the sums times 1 / e^(s - max)'s sum, as merge_spans
  // would have made them (its weight e^(m - m) is 1 and its total that sum: the same numbers)
  const bool whole = a.spans == 1;
  auto result = [&](int64_t pair) {
    const int64_t i = pair / group, g = pair % group;
    return whole ? a.out + (i * a.heads + kvh * group + g) * d : slot(i, g) + 2;
  };
  for (size_t b = 0; b < live.size(); b += V::kSums) {
    const int m = static_cast<int>(std::min<size_t>(V::kSums, live.size() - b));
    int64_t n[V::kSums];
    const float* w[V::kSums];
    float* out[V::kSums];
    for (int u = 0; u < m; ++u) {
      const int64_t pair = live[b + u];
      n[u] = r.seen[pair / group];
      w[u] = scores.data() + pair * kSpan;
      out[u] = result(pair);
    }
    V::weigh(m, r.v, d, w, n, out);
  }
  if (!whole) return;
  for (int64_t i = 0; i < Q; ++i)
    for (int64_t g = g0; g < g1; ++g) divide_by(a.out + (i * a.heads + kvh * group + g) * d, d, slot(i, g)[1]);
}

// The spans' partial results of query i, head h, merged in span order -> out[d].
template <typename KV>
void merge_spans(const SpanArgs<KV>& a, int64_t i, int64_t h, float* out) {
  const int64_t d = a.d;
  const float* part = a.partial + (i * a.heads + h) * a.spans * (d + 2);
  float top = -INFINITY;
  for (int64_t c = 0; c < a.spans; ++c)
    if (part[c * (d + 2) + 1] > 0.f) top = std::max(top, part[c * (d + 2)]);
  std::fill(out, out + d, 0.f);
  float total = 0.f;
  for (int64_t c = 0; c < a.spans; ++c) {  // spans of no keys skipped; a NaN span makes NaN
    const float* pc = part + c * (d + 2);
    if (pc[1] == 0.f) continue;
    const float w = std::exp(pc[0] - top);
    total += pc[1] * w;
    for (int64_t x = 0; x < d; ++x) out[x] += w * pc[2 + x];
  }
  divide_by(out, d, total);
}

template <typename KV>
torch::Tensor row_attention_of(torch::Tensor q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                               torch::Tensor block_table, torch::Tensor positions, int64_t key_start,
                               double scale) {
  q = q.contiguous();
  const torch::Tensor table = block_table.to(torch::kLong).contiguous();
  const torch::Tensor pos = positions.to(torch::kLong).contiguous();
  const int64_t Q = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t block = k_pool.size(1), kv_heads = k_pool.size(2), group = heads / kv_heads;
  TORCH_CHECK(heads % kv_heads == 0 && k_pool.size(3) == d, "heads, head_dim");
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  int64_t most = 0;
  for (int64_t i = 0; i < Q; ++i) most = std::max(most, pp[i] + 1);
  TORCH_CHECK(most <= table.numel() * block, "positions beyond the block table");
  for (int64_t b = 0, used = (most + block - 1) / block; b < used; ++b)
    TORCH_CHECK(tp[b] >= 0 && tp[b] < k_pool.size(0), "block id out of range");
  torch::Tensor out = torch::empty({Q, heads * d}, q.options());
  const float* qp = q.data_ptr<float>();
  const KV *kp = k_pool.data_ptr<KV>(), *vp = v_pool.data_ptr<KV>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t spans = (most + kSpan - 1) / kSpan;
  torch::Tensor partial = torch::empty({Q, heads, std::max<int64_t>(spans, 1), d + 2}, q.options());
  SpanArgs<KV> a{qp, kp, vp, tp, pp, heads, kv_heads, d, block, key_start, spans, sc, partial.data_ptr<float>(), op};
  const bool wide = quant_isa(0) == 512 && d % 16 == 0 && group <= 16;
  // a job per KV head and span; where those are fewer than two a thread (a short context), a
  // job per query head and span (the same numbers: each head's sums are computed alike either way)
  const int64_t split = kv_heads * spans < 2 * at::get_num_threads() ? group : 1, per = group / split;
  at::parallel_for(0, kv_heads * split * spans, 1, [&](int64_t b, int64_t e) {
    std::vector<float> scores;
    SpanRows<KV> rows;
    for (int64_t job = b; job < e; ++job) {
      const int64_t part = job % (kv_heads * split), kvh = part / split, g0 = part % split * per;
      const int64_t c = job / (kv_heads * split);
      if (wide)
        attend_span<Wide>(a, Q, kvh, g0, g0 + per, c, rows, scores);
      else
        attend_span<Narrow>(a, Q, kvh, g0, g0 + per, c, rows, scores);
    }
  });
  if (spans > 1)
    at::parallel_for(0, Q * heads, spans >= 8 ? 1 : Q * heads, [&](int64_t b, int64_t e) {
      for (int64_t ih = b; ih < e; ++ih) merge_spans(a, ih / heads, ih % heads, op + ih * d);
    });
  return out;
}

// One row's queries q [Q, heads, d] over its paged keys: query i attends keys
// key_start .. positions[i] (block_table maps key j to block table[j / block], slot j % block).
// Softmax in float32 with the maximum subtracted. -> [Q, heads * d]. By spans of keys as above,
// 16 lanes at a time with AVX-512 and d a multiple of 16 (up to 16 query heads a KV head), else 8
// (AVX2). On AVX2 the spans replaced a job per (query, KV head) over all its keys (one row's 3
// jobs on 2 threads): 30 layers' float16 pools at the default model's shapes, 2 threads, Zen 3,
// before / after, us a layer: 1 / 2 / 4 queries over 64 keys 8 / 10 / 16 -> 8 / 9 / 15, over 240
// 20 / 32 / 58 -> 16 / 28 / 41, over 1,000 101 / 158 / 256 -> 59 / 85 / 140, over 4,000 526 / 699 /
// 1,153 -> 303 / 392 / 586 (benchmarks/cpu_attention.py, best of 4 rounds each,
// cpu_s44_attention_spans_f16_2threads.json). The pools hold float32 or float16 (each element widened
// exactly to float32 as it is read: the same numbers as attending over the pools' .float()).
torch::Tensor row_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                            torch::Tensor block_table, torch::Tensor positions, int64_t key_start,
                            double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32, "float32 queries");
  check_pools(k_pool, v_pool);
  if (k_pool.scalar_type() == torch::kHalf)
    return row_attention_of<c10::Half>(q, k_pool, v_pool, block_table, positions, key_start, scale);
  return row_attention_of<float>(q, k_pool, v_pool, block_table, positions, key_start, scale);
}

// silu(gate) * up of [..., 2 I] (gate first) -> [..., I]
torch::Tensor silu_mul(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "float32");
  x = x.contiguous();
  const int64_t two = x.size(-1), I = two / 2, T = x.numel() / two;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = I;
  torch::Tensor y = torch::empty(shape, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // silu(g) = g * sigmoid(g), sigmoid from e = e^-|g| (never overflows): 1 / (1 + e) for g >= 0,
  // e / (1 + e) below; eight lanes at a time, rows split across threads past 16 k elements
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *g = xp + t * two, *u = g + I;
      float* out = yp + t * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp_nonpositive(_mm256_or_ps(gv, sign));
        const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, gv), _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
      }
      for (; i < I; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return y;
}

}  // namespace

torch::Tensor quant_matmul(torch::Tensor a, torch::Tensor w, torch::Tensor scale, torch::Tensor zero,
                           int64_t group, int64_t bits, int64_t activations);
torch::Tensor quant_dequantize(torch::Tensor w, torch::Tensor scale, torch::Tensor zero, int64_t group,
                               int64_t bits);
int64_t quant_isa(int64_t want);
bool quant_has_vnni();
torch::Tensor bf16_matmul(torch::Tensor a, torch::Tensor w);
torch::Tensor dense_matmul(torch::Tensor a, torch::Tensor w);

namespace {

// A group-quantized projection in quant_matmul's layout (bits 4 or 8), or a dense weight [N, K]
// (bfloat16 / float16: bits 16, float32: bits 32) for dense_matmul (scale, zero and group unused);
// ``out`` cuts pack's padding row; ``activations``: quant_matmul's (32 or 16 bits).
struct Projection {
  torch::Tensor words, scale, zero;
  int64_t group, bits, out, activations;

  torch::Tensor operator()(const torch::Tensor& a) const {
    torch::Tensor y = bits >= 16 ? dense_matmul(a, words)
                                 : quant_matmul(a, words, scale, zero, group, bits, activations);
    return y.size(1) == out ? y : y.narrow(1, 0, out).contiguous();
  }
};

// A pre-norm decoder layer's weights (quantized or bf16 projections, no biases, float32 norms), held
// once so that a decode step crosses from Python once per layer instead of a dozen times.
struct Layer {
  torch::Tensor ln1, ln2;
  double eps;
  Projection qkv, o, gate_up, down;
  int64_t heads, kv_heads, head_dim;
  c10::optional<torch::Tensor> q_norm, k_norm;
  double qk_eps, scale;

  // One row's tokens x [T, H] (+ delta) through the layer, the same steps in the same order as
  // layers.DecoderLayer.forward_chain on the CPU kernels: returns (residual, MLP output).
  std::vector<torch::Tensor> step(const torch::Tensor& x, c10::optional<torch::Tensor> delta,
                                  const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& slots,
                                  const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                                  const torch::Tensor& block_table, const torch::Tensor& positions,
                                  int64_t key_start) const {
    const int64_t H = x.size(-1);
    c10::optional<torch::Tensor> d;
    if (delta.has_value() && delta->defined()) d = delta->reshape({-1, H});
    std::vector<torch::Tensor> r = add_rms_norm(x.reshape({-1, H}), d, ln1, eps);
    const torch::Tensor q = rope_write(qkv(r[1]), cos, sin, slots, k_pool, v_pool, heads, kv_heads, head_dim,
                                       q_norm, k_norm, qk_eps);
    const torch::Tensor attended = o(row_attention(q, k_pool, v_pool, block_table, positions, key_start, scale));
    r = add_rms_norm(r[0], attended, ln2, eps);
    return {r[0].view(x.sizes()), down(silu_mul(gate_up(r[1]))).view(x.sizes())};
  }
};

// Philox4x32-10 (kernels/noise.py) of eight consecutive counters b0 .. b0 + 7 of one fill at once,
// eight lanes: element 4 (b - b0) + j of out[32] is word j of counter b, as the uniform
// (floor(x / 2^9) + 1/2) / 2^23 (exact in float32, never 0 or 1). The products' high words come
// from two 32 x 32 -> 64-bit multiplies (even and odd lanes), the low words from mullo.
inline __m256i mulhi_words(__m256i x, __m256i m) {
  const __m256i even = _mm256_srli_epi64(_mm256_mul_epu32(x, m), 32);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), m);
  return _mm256_blend_epi32(even, odd, 0xAA);
}

inline void philox_uniforms(uint32_t b0, uint64_t fill, uint64_t key, float* out) {
  __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(b0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i c1 = _mm256_setzero_si256();
  __m256i c2 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(fill)));
  __m256i c3 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(fill >> 32)));
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u)), m1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    const __m256i hi0 = mulhi_words(c0, m0), lo0 = _mm256_mullo_epi32(c0, m0);
    const __m256i hi1 = mulhi_words(c2, m1), lo1 = _mm256_mullo_epi32(c2, m1);
    c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32(static_cast<int>(k0)));
    c1 = lo1;
    c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32(static_cast<int>(k1)));
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  // counters across lanes -> each counter's four words together (a 4 x 4 transpose per half)
  const __m256i t0 = _mm256_unpacklo_epi32(c0, c1), t1 = _mm256_unpacklo_epi32(c2, c3);
  const __m256i t2 = _mm256_unpackhi_epi32(c0, c1), t3 = _mm256_unpackhi_epi32(c2, c3);
  const __m256i u0 = _mm256_unpacklo_epi64(t0, t1), u1 = _mm256_unpackhi_epi64(t0, t1);
  const __m256i u2 = _mm256_unpacklo_epi64(t2, t3), u3 = _mm256_unpackhi_epi64(t2, t3);
  const __m256i words[4] = {_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u2, u3, 0x20),
                            _mm256_permute2x128_si256(u0, u1, 0x31), _mm256_permute2x128_si256(u2, u3, 0x31)};
  for (int j = 0; j < 4; ++j) {
    const __m256 u = _mm256_cvtepi32_ps(_mm256_srli_epi32(words[j], 9));
    _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(_mm256_add_ps(u, _mm256_set1_ps(0.5f)),
                                                _mm256_set1_ps(1.1920928955078125e-07f)));
  }
}

// -log(u) for uniforms u in (0, 1) (normal floats), eight lanes: u = m 2^e with m in
// (sqrt(1/2), sqrt(2)], log m = f + f^3 P(f) - f^2 / 2 with f = m - 1 (Cephes' logf polynomial),
// e ln 2 in two parts; relative error about 1e-7. The exponential draws of every CPU race.
inline __m256 neg_log_unit(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  __m256i e = _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127));
  __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFF)),
                                                 _mm256_set1_epi32(0x3F800000)));  // [1, 2)
  const __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356237f), _CMP_GT_OQ);
  m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
  e = _mm256_sub_epi32(e, _mm256_castps_si256(big));  // the mask is -1 where m was halved
  const __m256 ef = _mm256_cvtepi32_ps(e);
  const __m256 f = _mm256_sub_ps(m, _mm256_set1_ps(1.f));
  const __m256 z = _mm256_mul_ps(f, f);
  __m256 poly = _mm256_set1_ps(7.0376836292e-2f);
  for (const float c : {-1.1514610310e-1f, 1.1676998740e-1f, -1.2420140846e-1f, 1.4249322787e-1f,
                        -1.6668057665e-1f, 2.0000714765e-1f, -2.4999993993e-1f, 3.3333331174e-1f})
    poly = _mm256_fmadd_ps(poly, f, _mm256_set1_ps(c));
  __m256 y = _mm256_mul_ps(_mm256_mul_ps(poly, f), z);
  y = _mm256_fmadd_ps(ef, _mm256_set1_ps(-2.12194440e-4f), y);
  y = _mm256_fnmadd_ps(_mm256_set1_ps(0.5f), z, y);
  const __m256 r = _mm256_fmadd_ps(ef, _mm256_set1_ps(0.693359375f), _mm256_add_ps(f, y));
  return _mm256_sub_ps(_mm256_setzero_ps(), r);
}

// Elements [first, first + 32) of a fill as uniforms or exponentials (out[32]).
inline void philox_numbers(int64_t first, uint64_t fill, uint64_t key, bool exponential, float* out) {
  philox_uniforms(static_cast<uint32_t>(first / 4), fill, key, out);
  if (exponential)
    for (int j = 0; j < 32; j += 8) _mm256_storeu_ps(out + j, neg_log_unit(_mm256_loadu_ps(out + j)));
}

// Philox4x32-10 fills (kernels/noise.py): out [R, F, n] float32, contiguous in n, gets fill
// fills[r, f] of the stream keyed keys[r]: element i is word i % 4 of Philox at counter
// (i / 4, 0, fill low, fill high), made a uniform (floor(x / 2^9) + 1/2) / 2^23 (exact in float32,
// never 0 or 1), then -log of it for exponential draws (``neg_log_unit``: the numbers
// ``philox_race`` races with).
torch::Tensor philox_fill(torch::Tensor out, const torch::Tensor& keys, const torch::Tensor& fills, bool exponential) {
  TORCH_CHECK(out.dim() == 3 && out.scalar_type() == torch::kFloat32 && out.stride(2) == 1,
              "philox_fill: out must be [R, F, n] float32, contiguous in n");
  TORCH_CHECK(keys.scalar_type() == torch::kInt64 && fills.scalar_type() == torch::kInt64 &&
              keys.dim() == 1 && fills.dim() == 2 && fills.stride(1) == 1,
              "philox_fill: keys [R] and fills [R, F] int64");
  TORCH_CHECK(out.device().is_cpu() && keys.device().is_cpu() && fills.device().is_cpu(),
              "philox_fill: CPU tensors only");
  const int64_t R = out.size(0), F = out.size(1), n = out.size(2);
  TORCH_CHECK(keys.size(0) == R && fills.size(0) == R && fills.size(1) == F, "philox_fill: shapes disagree");
  float* o = out.data_ptr<float>();
  const int64_t* k = keys.data_ptr<int64_t>();
  const int64_t* fl = fills.data_ptr<int64_t>();
  const int64_t so_r = out.stride(0), so_f = out.stride(1), sk = keys.stride(0), sf = fills.stride(0);
  // work items: chunks of 4,096 numbers of one fill (a 49,152-token race is 12 of them)
  const int64_t chunk = 4096, chunks = (n + chunk - 1) / chunk;
  at::parallel_for(0, R * F * chunks, 1, [&](int64_t begin, int64_t end) {
    float numbers[32];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t rf = item / chunks, first = (item % chunks) * chunk;
      const int64_t r = rf / F, f = rf % F;
      const uint64_t key = static_cast<uint64_t>(k[r * sk]), at = static_cast<uint64_t>(fl[r * sf + f]);
      float* row = o + r * so_r + f * so_f;
      for (int64_t i = first; i < std::min(first + chunk, n); i += 32) {
        philox_numbers(i, at, key, exponential, numbers);
        std::copy(numbers, numbers + std::min<int64_t>(32, n - i), row + i);
      }
    }
  });
  return out;
}

// The best of one span of a race: the largest dist[v] / E_v and its (first) index v, whether
// any dist[v] there is above 0, and the first v whose ratio is NaN (-1: none; torch.argmax takes
// a NaN as the largest value, as the PyTorch path does for a distribution of NaNs).
struct RaceBest {
  float value = -1.f;
  int64_t index = -1;
  bool positive = false;
  int64_t nan = -1;
};

// A race over elements [first, end) of dist (the distribution's row; for a residual, p and q or
// the rejected one-hot draft ``drop``): dist[v] / E_v with E_v the fill's exponentials (a fill
// below 0: E_v = 1, an argmax). residual: 0 plain p, 1 p with ``drop`` removed, 2 max(p - q, 0)
// (a NaN stays NaN, as PyTorch's clamp keeps it).
RaceBest race_span(const float* p, const float* q, int64_t drop, int residual, int64_t first, int64_t end,
                   int64_t fill, uint64_t key) {
  float e[32], d[32];
  __m256 best = _mm256_set1_ps(-1.f);
  __m256i best_at = _mm256_set1_epi32(-1);
  __m256 positive = _mm256_setzero_ps();
  int64_t nan = -1;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t i = first; i < end; i += 32) {
    const int64_t n = std::min<int64_t>(32, end - i);
    if (fill >= 0) philox_numbers(i, static_cast<uint64_t>(fill), key, true, e);
    else std::fill(e, e + 32, 1.f);
    const bool whole = n == 32 && !(residual == 1 && drop >= i && drop < i + 32);
    const float* src = p + i;
    if (!whole) {  // the span's tail, or the block holding the dropped draft: through a copy
      for (int64_t j = 0; j < 32; ++j) d[j] = j < n ? p[i + j] : 0.f;
      if (residual == 1 && drop >= i && drop < i + n) d[drop - i] = 0.f;
      src = d;
    }
    for (int j = 0; j < 32 && j < n; j += 8) {
      __m256 dv = _mm256_loadu_ps(src + j);
      if (residual == 2) {
        __m256 qv;
        if (j + 8 <= n) {
          qv = _mm256_loadu_ps(q + i + j);
        } else {  // a tail's last vector of q
          float tail[8] = {0.f};
          std::copy(q + i + j, q + i + n, tail);
          qv = _mm256_loadu_ps(tail);
        }
        const __m256 diff = _mm256_sub_ps(dv, qv);
        dv = _mm256_blendv_ps(_mm256_max_ps(diff, _mm256_setzero_ps()), diff, _mm256_cmp_ps(diff, diff, _CMP_UNORD_Q));
      }
      __m256 ratio = _mm256_div_ps(dv, _mm256_loadu_ps(e + j));
      const int nans = _mm256_movemask_ps(_mm256_cmp_ps(ratio, ratio, _CMP_UNORD_Q)) & ((1 << std::min<int64_t>(8, n - j)) - 1);
      if (nans && nan < 0) nan = i + j + __builtin_ctz(nans);
      if (j + 8 > n)  // lanes past the span's end never win
        ratio = _mm256_blendv_ps(ratio, _mm256_set1_ps(-INFINITY),
                                 _mm256_castsi256_ps(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(static_cast<int>(n - j - 1)))));
      const __m256 better = _mm256_cmp_ps(ratio, best, _CMP_GT_OQ);  // strictly: a lane keeps its first maximum
      best = _mm256_blendv_ps(best, ratio, better);
      const __m256i at = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(i - first + j)), lane);
      best_at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_at), _mm256_castsi256_ps(at), better));
      positive = _mm256_or_ps(positive, _mm256_cmp_ps(dv, _mm256_setzero_ps(), _CMP_GT_OQ));
    }
  }
  float values[8];
  int32_t at[8];
  _mm256_storeu_ps(values, best);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), best_at);
  RaceBest out;
  for (int l = 0; l < 8; ++l)  // the largest value; among equal ones the first index
    if (at[l] >= 0 && (values[l] > out.value || (values[l] == out.value && first + at[l] < out.index))) {
      out.value = values[l];
      out.index = first + at[l];
    }
  out.positive = _mm256_movemask_ps(positive) != 0;
  out.nan = nan;
  return out;
}

// Exact rejection sampling of rows' drafts, the emitted token drawn by an exponential race, on
// the CPU in one call (speculative.rejection_outcome's decision from these rows' noise streams;
// k = 0: a plain sample, argmax p / E). target [R, k + 1, V] float32; draft [R, k, V] float32 or
// empty ([0]: one-hot drafts); drafts [R, k] int64; depths [R] int64 (each row's own number of
// drafts); keys [R] int64; fills [R, 2] int64: the fill of the row's k acceptance uniforms (read
// where k > 0) and of its race over V (below 0: none, the argmax). Draft i is accepted when
// u_i < min(1, p_i(x_i) / q_i(x_i)), left to right; after a rejection the race runs over the
// residual max(0, p_i - q_i) (for a one-hot draft p_i without x_i; p_i where rounding leaves it
// no mass), after every draft over p_k. Not divided by the residual's mass: the same race
// winner in exact arithmetic. Returns [R, k + 2]: drafts, accepted, token.
torch::Tensor philox_race(const torch::Tensor& target, const torch::Tensor& draft, const torch::Tensor& drafts,
                          const torch::Tensor& depths, const torch::Tensor& keys, const torch::Tensor& fills) {
  TORCH_CHECK(target.dim() == 3 && target.scalar_type() == torch::kFloat32 && target.is_contiguous() &&
              target.device().is_cpu(), "philox_race: target must be [R, k + 1, V] float32, contiguous, on the CPU");
  const int64_t R = target.size(0), k = target.size(1) - 1, V = target.size(2);
  const bool one_hot = draft.numel() == 0;
  TORCH_CHECK(one_hot || (draft.scalar_type() == torch::kFloat32 && draft.is_contiguous() &&
                          draft.sizes() == torch::IntArrayRef({R, k, V})), "philox_race: draft must be [R, k, V] float32");
  TORCH_CHECK(drafts.scalar_type() == torch::kInt64 && drafts.dim() == 2 && drafts.size(0) == R && drafts.size(1) == k &&
              depths.scalar_type() == torch::kInt64 && depths.numel() == R && keys.scalar_type() == torch::kInt64 &&
              keys.numel() == R && fills.scalar_type() == torch::kInt64 && fills.dim() == 2 && fills.size(0) == R &&
              fills.size(1) == 2, "philox_race: drafts [R, k], depths [R], keys [R] and fills [R, 2] int64");
  const torch::Tensor x = drafts.contiguous(), dep = depths.contiguous(), ks = keys.contiguous(), fs = fills.contiguous();
  const int64_t *xs = x.data_ptr<int64_t>(), *ds = dep.data_ptr<int64_t>(), *kp = ks.data_ptr<int64_t>(),
                *fp = fs.data_ptr<int64_t>();
  for (int64_t i = 0; i < R * k; ++i) TORCH_CHECK(xs[i] >= 0 && xs[i] < V, "philox_race: a draft lies outside the vocabulary");
  const float* tp = target.data_ptr<float>();
  const float* qp = one_hot ? nullptr : draft.data_ptr<float>();
  torch::Tensor out = torch::empty({R, k + 2}, drafts.options());
  int64_t* o = out.data_ptr<int64_t>();
  // each row's decision (k tiny), then its race, split into spans over the vocabulary
  std::vector<int64_t> accepted(R);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = std::min(std::max<int64_t>(ds[r], 0), k);
    float u[32];
    int64_t a = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (i % 32 == 0) philox_numbers(i, static_cast<uint64_t>(fp[2 * r]), static_cast<uint64_t>(kp[r]), false, u);
      const int64_t xi = xs[r * k + i];
      const float p_x = tp[(r * (k + 1) + i) * V + xi];
      const float ratio = one_hot ? p_x : p_x / std::max(qp[(r * k + i) * V + xi], std::numeric_limits<float>::min());
      if (!(u[i % 32] < std::min(ratio, 1.f))) break;
      a = i + 1;
    }
    accepted[r] = a;
    for (int64_t i = 0; i < k; ++i) o[r * (k + 2) + i] = xs[r * k + i];
    o[r * (k + 2) + k] = a;
  }
  const int64_t span = 4096, spans = (V + span - 1) / span;
  std::vector<RaceBest> best(R * spans);
  std::vector<char> redo(R, 0);  // rows whose residual had no mass
  auto run = [&](bool plain_only) {
    at::parallel_for(0, R * spans, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t r = item / spans, first = (item % spans) * span;
        if (plain_only && !redo[r]) continue;
        const int64_t a = accepted[r], n = std::min(std::max<int64_t>(ds[r], 0), k);
        const int residual = plain_only || a >= n ? 0 : (one_hot ? 1 : 2);
        const float* p = tp + (r * (k + 1) + a) * V;
        const float* q = residual == 2 ? qp + (r * k + a) * V : nullptr;
        best[item] = race_span(p, q, residual == 1 ? xs[r * k + a] : -1, residual, first, std::min(first + span, V),
                               fp[2 * r + 1], static_cast<uint64_t>(kp[r]));
      }
    });
  };
  auto winner = [&](int64_t r) {
    RaceBest w;
    bool positive = false;
    int64_t nan = -1;
    for (int64_t s = 0; s < spans; ++s) {  // spans in order: a later one must be strictly larger
      const RaceBest& b = best[r * spans + s];
      positive = positive || b.positive;
      if (nan < 0) nan = b.nan;
      if (b.index >= 0 && (w.index < 0 || b.value > w.value)) w = b;
    }
    w.positive = positive;
    w.nan = nan;
    if (nan >= 0) w.index = nan;  // torch.argmax's answer where a ratio is NaN
    return w;
  };
  run(false);
  bool again = false;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = std::min(std::max<int64_t>(ds[r], 0), k);
    const RaceBest w = winner(r);
    if (accepted[r] < n && (!w.positive || w.nan >= 0)) {  // a residual of no mass (rounding) or
      redo[r] = 1;                                            // NaN mass: race over p itself
      again = true;
    }
  }
  if (again) run(true);
  for (int64_t r = 0; r < R; ++r) o[r * (k + 2) + k + 1] = winner(r).index;
  return out;
}

// top-p's threshold for each row of probs [N, V] (float32, contiguous) at top_p [N] (float32):
// sampling._nucleus_threshold's answer, the value at index n - 1 of the row sorted descending, n
// the number of tokens whose mass strictly before them is below top_p (at least one; the mass
// as PyTorch's cumsum gives it, a float64 running sum rounded to float32, minus the token). The
// row's descending order is built only as far as needed, in chunks (nth_element, then a sort of
// the chunk), until the mass before the last token sorted reaches top_p + 1e-5 (the PyTorch path's
// test for a top-k that is long enough; past it no token counts), first among the tokens at or
// above the row's maximum / 2^12, else / 2^24, else among all of them (where the order may run
// to the end: a full sort, no test). The same sorted prefix, so the same threshold. A row with top_p >= 1 is
// not filtered: 0.
// The row's largest value where the caller does not know it (top below 0) scales the first two
// bounds; any bound gives the same threshold (the test above), a good one a short candidate list.
float row_nucleus(const float* p, int64_t V, float tp, std::vector<float>& cand, float top = -1.f) {
  if (!(tp < 1.f)) return 0.f;
  const float enough = tp + 1e-5f;  // (float32, as the PyTorch path adds it)
  int64_t v = 0;
  if (top < 0.f) {
    __m256 tops[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; v + 32 <= V; v += 32)
      for (int j = 0; j < 4; ++j) tops[j] = _mm256_max_ps(tops[j], _mm256_loadu_ps(p + v + 8 * j));
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(tops[0], tops[1]), _mm256_max_ps(tops[2], tops[3])));
    top = *std::max_element(lanes, lanes + 8);
    for (; v < V; ++v) top = std::max(top, p[v]);
  }
  for (const float scale : {1.f / 4096.f, 1.f / 16777216.f, 0.f}) {
    const bool whole = scale == 0.f;
    const float bound = whole ? -INFINITY : top * scale;
    cand.clear();
    const __m256 b = _mm256_set1_ps(bound);
    v = 0;
    for (; v + 8 <= V; v += 8) {
      int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + v), b, _CMP_GE_OQ));
      while (mask) {
        cand.push_back(p[v + __builtin_ctz(mask)]);
        mask &= mask - 1;
      }
    }
    for (; v < V; ++v)
      if (p[v] >= bound) cand.push_back(p[v]);
    double running = 0.0;
    int64_t keep = 0;
    float before = 0.f;
    bool found = false;
    for (size_t done = 0, chunk = 256; done < cand.size() && !found; chunk *= 4) {
      const size_t upto = std::min(cand.size(), done + chunk);
      if (upto < cand.size())  // the chunk's tokens: the largest of those not yet sorted
        std::nth_element(cand.begin() + done, cand.begin() + upto, cand.end(), std::greater<float>());
      std::sort(cand.begin() + done, cand.begin() + upto, std::greater<float>());
      for (size_t i = done; i < upto; ++i) {
        running += cand[i];
        before = static_cast<float>(running) - cand[i];
        keep += before < tp;
      }
      done = upto;
      found = before >= enough;
    }
    if (found || whole) return cand.empty() ? 0.f : cand[std::max<int64_t>(keep, 1) - 1];
  }
  return 0.f;  // (not reached: the whole row always answers)
}

torch::Tensor nucleus_threshold(const torch::Tensor& probs, const torch::Tensor& top_p) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == torch::kFloat32 && probs.is_contiguous() &&
              probs.device().is_cpu(), "nucleus_threshold: probs must be [N, V] float32, contiguous, on the CPU");
  const int64_t N = probs.size(0), V = probs.size(1);
  TORCH_CHECK(top_p.scalar_type() == torch::kFloat32 && top_p.numel() == N, "nucleus_threshold: top_p [N] float32");
  TORCH_CHECK(V > 0, "nucleus_threshold: an empty vocabulary");
  const torch::Tensor tps = top_p.contiguous();
  const float* pp = probs.data_ptr<float>();
  const float* tpp = tps.data_ptr<float>();
  torch::Tensor out = torch::empty({N, 1}, probs.options());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> cand;
    for (int64_t r = begin; r < end; ++r) o[r] = row_nucleus(pp + r * V, V, tpp[r], cand);
  });
  return out;
}

// acc + the eight lanes of x, widened to float64 (two lanes of acc each).
inline __m256d add_widened(__m256d acc, __m256 x) {
  return _mm256_add_pd(_mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_castps256_ps128(x))),
                       _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
}

inline double sum_lanes(__m256d acc) {
  double lanes[4];
  _mm256_storeu_pd(lanes, acc);
  return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

// sampling.process_logits' temperature, top-p and greedy rows (top-k's cut comes before it, min-p
// after it, in Python), one call: logits [N, V] float32
// (contiguous; penalties and masks applied) -> probs [N, V]. A greedy row: a one-hot of its first
// maximum (a NaN counts as the largest, as torch.argmax). Else softmax((l - max) / temperature),
// the exponentials by exp_nonpositive (between -104 and -87 by std::exp: subnormals as PyTorch
// gives them; below, 0: a masked token's -inf, a pruned draft row's -1e20), each times 1 / their sum; then for top_p < 1 the tokens below the row's
// nucleus threshold (row_nucleus: nucleus_threshold's) set to 0 and the rest divided by their sum.
// A row whose maximum is -inf or NaN gives NaN, as the PyTorch ops do. Float32 throughout; the
// numbers differ from PyTorch's softmax in the last bits (its exp and summation order), the kept
// tokens do not.
torch::Tensor process_probs(const torch::Tensor& logits, const torch::Tensor& temperature, const torch::Tensor& top_p,
                            const torch::Tensor& greedy) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous() &&
              logits.device().is_cpu(), "process_probs: logits must be [N, V] float32, contiguous, on the CPU");
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "process_probs: an empty vocabulary");
  TORCH_CHECK(temperature.scalar_type() == torch::kFloat32 && temperature.numel() == N &&
              top_p.scalar_type() == torch::kFloat32 && top_p.numel() == N &&
              greedy.scalar_type() == torch::kBool && greedy.numel() == N,
              "process_probs: temperature, top_p [N] float32 and greedy [N] bool");
  const torch::Tensor ts = temperature.contiguous(), tps = top_p.contiguous(), gs = greedy.contiguous();
  const float *lp = logits.data_ptr<float>(), *tp = ts.data_ptr<float>(), *tpp = tps.data_ptr<float>();
  const bool* gp = gs.data_ptr<bool>();
  torch::Tensor out = torch::empty({N, V}, logits.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> cand;
    for (int64_t r = begin; r < end; ++r) {
      const float* l = lp + r * V;
      float* o = op + r * V;
      if (gp[r]) {
        int64_t arg = 0;
        for (int64_t v = 0; v < V; ++v) {  // the first maximum; a NaN wins
          if (std::isnan(l[v])) {
            arg = v;
            break;
          }
          if (l[v] > l[arg]) arg = v;
        }
        std::fill(o, o + V, 0.f);
        o[arg] = 1.f;
        continue;
      }
      __m256 tops = _mm256_set1_ps(-INFINITY), nans = _mm256_setzero_ps();
      int64_t u = 0;
      for (; u + 8 <= V; u += 8) {
        const __m256 x = _mm256_loadu_ps(l + u);
        tops = _mm256_max_ps(tops, x);
        nans = _mm256_or_ps(nans, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      }
      float lanes8[8];
      _mm256_storeu_ps(lanes8, tops);
      float top = *std::max_element(lanes8, lanes8 + 8);
      bool nan = _mm256_movemask_ps(nans) != 0;
      for (; u < V; ++u) {
        nan = nan || std::isnan(l[u]);
        top = std::max(top, l[u]);
      }
      if (nan || top == -INFINITY) {
        std::fill(o, o + V, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      const __m256 mv = _mm256_set1_ps(top), tv = _mm256_set1_ps(tp[r]), floor = _mm256_set1_ps(-87.f);
      __m256d acc = _mm256_setzero_pd();  // sums in float64: a float32 lane over 6,144 terms drifts by ~1e-5
      int64_t v = 0;
      for (; v + 8 <= V; v += 8) {
        const __m256 x = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(l + v), mv), tv);
        // below -87 the result is subnormal: std::exp, as PyTorch's exp gives them, between
        // -104 and -87; below -104 (a masked token's -inf, a pruned draft row's -1e20) exactly 0
        __m256 e = _mm256_and_ps(exp_nonpositive(x), _mm256_cmp_ps(x, floor, _CMP_GE_OQ));
        if (const int low = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(x, floor, _CMP_LT_OQ),
                                                             _mm256_cmp_ps(x, _mm256_set1_ps(-104.f), _CMP_GE_OQ)))) {
          float xs[8], es[8];
          _mm256_storeu_ps(xs, x);
          _mm256_storeu_ps(es, e);
          for (int j = 0; j < 8; ++j)
            if (low >> j & 1) es[j] = std::exp(xs[j]);
          e = _mm256_loadu_ps(es);
        }
        _mm256_storeu_ps(o + v, e);
        acc = add_widened(acc, e);
      }
      double total = sum_lanes(acc);
      for (; v < V; ++v) {
        const float x = (l[v] - top) / tp[r];
        o[v] = x >= -104.f ? std::exp(x) : 0.f;
        total += o[v];
      }
      auto scale_row = [&](float inv) {
        const __m256 iv = _mm256_set1_ps(inv);
        int64_t u = 0;
        for (; u + 8 <= V; u += 8) _mm256_storeu_ps(o + u, _mm256_mul_ps(_mm256_loadu_ps(o + u), iv));
        for (; u < V; ++u) o[u] *= inv;
      };
      const float inv = static_cast<float>(1.0 / total);
      scale_row(inv);
      if (!(tpp[r] < 1.f)) continue;
      const float threshold = row_nucleus(o, V, tpp[r], cand, inv);  // the top logit's e^0 = 1, times inv
      const __m256 th = _mm256_set1_ps(threshold);
      __m256d kept = _mm256_setzero_pd();
      v = 0;
      for (; v + 8 <= V; v += 8) {
        const __m256 x = _mm256_loadu_ps(o + v);
        const __m256 k = _mm256_and_ps(x, _mm256_cmp_ps(x, th, _CMP_GE_OQ));
        _mm256_storeu_ps(o + v, k);
        kept = add_widened(kept, k);
      }
      double mass = sum_lanes(kept);
      for (; v < V; ++v) {
        o[v] = o[v] >= threshold ? o[v] : 0.f;
        mass += o[v];
      }
      scale_row(static_cast<float>(1.0 / mass));
    }
  });
  return out;
}

// The index of the first maximum of x[0 .. n) (n >= 1), as torch.argmax: the first NaN where
// there is one. Four chains of eight lanes (independent, so their compares overlap) keep each
// their first maximum (strict >) of every fourth block of eight, then the 32 maxima are compared,
// equal values going to the lower index; the tail runs on after them.
inline int64_t first_max(const float* x, int64_t n) {
  constexpr int C = 4;
  int64_t j = 0, at = 0;
  float top = x[0];
  if (n >= 8 * C) {
    __m256 best[C], nan = _mm256_setzero_ps();
    __m256i where[C];
    for (int c = 0; c < C; ++c) {
      best[c] = _mm256_loadu_ps(x + 8 * c);
      where[c] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * c));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(best[c], best[c], _CMP_UNORD_Q));
    }
    __m256i idx = where[0];
    const __m256i step = _mm256_set1_epi32(8 * C), eight = _mm256_set1_epi32(8);
    for (j = 8 * C; j + 8 * C <= n; j += 8 * C) {
      idx = _mm256_add_epi32(idx, step);
      __m256i at_c = idx;
      for (int c = 0; c < C; ++c) {
        const __m256 v = _mm256_loadu_ps(x + j + 8 * c);
        const __m256 gt = _mm256_cmp_ps(v, best[c], _CMP_GT_OQ);
        best[c] = _mm256_blendv_ps(best[c], v, gt);
        where[c] = _mm256_blendv_epi8(where[c], at_c, _mm256_castps_si256(gt));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        at_c = _mm256_add_epi32(at_c, eight);
      }
    }
    if (_mm256_movemask_ps(nan)) {
      for (int64_t i = 0;; ++i) if (std::isnan(x[i])) return i;
    }
    alignas(32) float lane[8 * C];
    alignas(32) int32_t lane_at[8 * C];
    for (int c = 0; c < C; ++c) {
      _mm256_store_ps(lane + 8 * c, best[c]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(lane_at + 8 * c), where[c]);
    }
    top = lane[0];
    at = lane_at[0];
    for (int l = 1; l < 8 * C; ++l)
      if (lane[l] > top || (lane[l] == top && lane_at[l] < at)) top = lane[l], at = lane_at[l];
  } else if (std::isnan(top)) {
    return 0;
  } else {
    j = 1;
  }
  for (; j < n; ++j) {
    if (std::isnan(x[j])) return j;
    if (x[j] > top) top = x[j], at = j;
  }
  return at;
}

}  // namespace

// The first maximum of each row of x [..., N] float32 (torch.argmax(x, -1)'s indices: ties to the
// lowest index, the first NaN where a row has one) -> [...] int64. One pass, no threads: on this
// project's CPU about 3 us a 49,152-entry row, where torch.argmax takes about 15.
torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() >= 1 && x.size(-1) > 0,
              "x: [..., N] float32, contiguous, N > 0");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  auto out = torch::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) op[r] = first_max(xp + r * n, n);
  return out;
}

// Greedy acceptance of R rows at once from the verify's logits [R, k + 1, V] float32 and the
// drafts [R, k] int64 (each row's acceptance capped by depths [R, 1] int64 when given, else k):
// argmax_rows at every position, the drafts accepted while each equals the argmax before it,
// the next token the argmax at the first miss (the bonus when all are accepted). Returns
// speculative.greedy_outcome's packed [R, k + 2] int64: drafts, accepted count, next token.
torch::Tensor greedy_verify(const torch::Tensor& logits, const torch::Tensor& drafts,
                            const c10::optional<torch::Tensor>& depths) {
  TORCH_CHECK(logits.dim() == 3 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous(),
              "logits: [R, k + 1, V] float32, contiguous");
  const int64_t R = logits.size(0), k = logits.size(1) - 1, V = logits.size(2);
  TORCH_CHECK(V > 0 && drafts.dim() == 2 && drafts.size(0) == R && drafts.size(1) == k &&
              drafts.scalar_type() == torch::kLong, "drafts: [R, k] int64");
  const auto d = drafts.contiguous();
  c10::optional<torch::Tensor> cap;
  if (depths.has_value()) {
    TORCH_CHECK(depths->numel() == R && depths->scalar_type() == torch::kLong, "depths: [R, 1] int64");
    cap = depths->contiguous();
  }
  auto out = torch::empty({R, k + 2}, drafts.options());
  const float* lp = logits.data_ptr<float>();
  const int64_t* dp = d.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t limit = cap.has_value() ? std::min<int64_t>(k, std::max<int64_t>(0, cap->data_ptr<int64_t>()[r])) : k;
    int64_t a = 0, next = first_max(lp + (r * (k + 1)) * V, V);
    while (a < limit && next == dp[r * k + a]) {
      ++a;
      next = first_max(lp + (r * (k + 1) + a) * V, V);
    }
    for (int64_t j = 0; j < k; ++j) op[r * (k + 2) + j] = dp[r * k + j];
    op[r * (k + 2) + k] = a;
    op[r * (k + 2) + k + 1] = next;
  }
  return out;
}

// Whether a finite key or value became float16's inf in a float16 pool since the last call (clears it).
bool take_half_overflow() { return half_overflow.exchange(false, std::memory_order_relaxed); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_matmul", &quant_matmul, "a [M, K] float32 @ group-quantized w [N, K]^T -> [M, N] float32");
  m.def("quant_has_vnni", &quant_has_vnni, "whether the CPU has AVX-512 VNNI (int16 activations on its 512-bit tile)");
  m.def("quant_isa", &quant_isa, "the float products' vector width (256 or 512); a width forces it, 0 reads it");
  m.def("bf16_matmul", &bf16_matmul, "a [M, K] float32 @ a bfloat16 w [N, K]^T -> [M, N] float32");
  m.def("dense_matmul", &dense_matmul, "a [M, K] float32 @ a bfloat16, float16 or float32 w [N, K]^T -> [M, N] float32");
  m.def("quant_dequantize", &quant_dequantize, "the float32 weight of quant_matmul's layout");
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, rmsnorm(x + delta) * w)");
  m.def("rope_write", &rope_write, "q/k norms, RoPE and the KV write of a fused qkv projection");
  m.def("row_attention", &row_attention, "one row's queries over its paged keys");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("philox_fill", &philox_fill, "Philox4x32-10 uniforms or exponentials of many streams' fills");
  m.def("nucleus_threshold", &nucleus_threshold, "top-p's threshold of each row of probabilities");
  m.def("process_probs", &process_probs, "temperature, top-p and greedy rows' logits to probabilities");
  m.def("take_half_overflow", &take_half_overflow, "whether a float16 pool write overflowed since the last call");
  m.def("argmax_rows", &argmax_rows, "the first maximum of each row (torch.argmax's indices)");
  m.def("greedy_verify", &greedy_verify, "greedy acceptance from the verify's logits and the drafts");
  m.def("philox_race", &philox_race, "exact rejection sampling with exponential races from rows' fills");
  pybind11::class_<Projection>(m, "Projection")
      .def(pybind11::init<torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t, int64_t>());
  pybind11::class_<Layer>(m, "Layer")
      .def(pybind11::init<torch::Tensor, torch::Tensor, double, Projection, Projection, Projection, Projection,
                          int64_t, int64_t, int64_t, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                          double, double>())
      .def("step", &Layer::step, "one row's tokens [T, H] through the layer -> (residual, MLP output)");
}
