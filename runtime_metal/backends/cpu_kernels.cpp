// Weight-only low-bit matmul kernels for x86 CPUs with AVX2 + FMA (fuselm runtime, torch backend).
//
// torch's own CPU kernels (_weight_int4pack_mm_for_cpu, _weight_int8pack_mm) are scalar without
// AVX-512 and 10-20x slower than an f32 GEMV on AVX2 machines, so fuselm ships these. They are
// built once per machine by torch.utils.cpp_extension (runtime_metal/backends/torch_quant.py).
//
// Weights are W[n, k] = (q[n, k] - zp[n, b]) * scale[n, b] (b = k / block; zp uint8, scale f32),
// output channels n in rows, the reduction dim k contiguous.
//
// gemv (decode: a few rows of x). x is rounded to int16 per sub-block of 32 values (dx = max|x| /
// 32767: a relative error of at most 1.5e-5 of the sub-block's largest value, 250x finer than
// bf16; int8 activations, onnxruntime's default, would be 128x coarser), so q . x runs as exact
// int32 multiply-adds (vpmaddwd: 16 products, summed in pairs). The layout `pack` makes at load
// puts each sub-block in its own 32-bit lane: k is cut in groups of 8 sub-blocks (256 values), and
// in a group the int32 lane j of multiply-add t (t = 0..15) holds the pair k = 32 j + 2 t, +1.
// Sixteen multiply-adds summed lane-wise thus leave the 8 sub-blocks' dot products in one vector,
// and three vector ops apply their scales, zero points and x scales: no horizontal sums, no
// broadcasts. x is arranged in the same order once per call.
//   y[m, n] = sum_b scale[n, b] * (dx[m, b] * (q[n, b] . xq[m, b]) - zp[n, b] * xsum[m, b])
// with xsum = dx * sum of the rounded x of the sub-block: the zero-point term sees the same x as
// q . x, so the rounding error scales with q - zp, not with q.
//
// Layout per row, per group of 256 k (rows padded with q = 0, scale = 0 to whole groups: Kp):
//   4 bits: 4 loads of 32 bytes; in load L, 16-bit word p (lane j = p / 2) holds 4 nibbles, nibble
//           i (bits 4i..4i+3) = q[k = 32 j + 2 (4 L + i) + p % 2]. Nibbles 1 and 2 are masked in
//           place (16x and 256x the value: the sums are shifted back, exactly), nibble 3 shifted.
//   8 bits: 8 loads; in load L, word p holds bytes i = 0, 1 = q[k = 32 j + 2 (2 L + i) + p % 2].
//   scale [N, Kp/32] f32 and zp [N, Kp/32] u8, one per sub-block (blocks of 64+ repeat theirs).
// dequant (prefill, many rows): W [N, K] as f32 for a BLAS GEMM (exact f32 activations).

#include <torch/extension.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <vector>
#include <immintrin.h>

namespace {

constexpr int64_t GROUP = 256;  // k per group of 8 sub-blocks of 32
constexpr int64_t PREFETCH_BYTES = 1536;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline __m256 load_u8_ps(const uint8_t* p) {  // 8 bytes as 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// The 8 sub-blocks' int32 dots q . xq of one group of one weight row, for M rows of x (xa: the
// group's 256 arranged x values per row, `stride` apart).
template <int BITS, int M>
inline void group_dots(const uint8_t* w, const int16_t* xa, int64_t stride, __m256i* dots) {
  if (BITS == 4) {
    const __m256i m0 = _mm256_set1_epi16(0x000F), m1 = _mm256_set1_epi16(0x00F0), m2 = _mm256_set1_epi16(0x0F00);
    __m256i a[M][3];  // nibble 0 and 3 | nibble 1 (x16) | nibble 2 (x256)
    for (int m = 0; m < M; ++m) a[m][0] = a[m][1] = a[m][2] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int L = 0; L < 4; ++L) {
      const __m256i v = load256(w + 32 * L);
      const __m256i e0 = _mm256_and_si256(v, m0), e1 = _mm256_and_si256(v, m1), e2 = _mm256_and_si256(v, m2),
                    e3 = _mm256_srli_epi16(v, 12);
      for (int m = 0; m < M; ++m) {
        const int16_t* x = xa + m * stride + 64 * L;
        a[m][0] = _mm256_add_epi32(a[m][0], _mm256_add_epi32(_mm256_madd_epi16(e0, load256(x)),
                                                             _mm256_madd_epi16(e3, load256(x + 48))));
        a[m][1] = _mm256_add_epi32(a[m][1], _mm256_madd_epi16(e1, load256(x + 16)));
        a[m][2] = _mm256_add_epi32(a[m][2], _mm256_madd_epi16(e2, load256(x + 32)));
      }
    }
    for (int m = 0; m < M; ++m)
      dots[m] = _mm256_add_epi32(a[m][0], _mm256_add_epi32(_mm256_srai_epi32(a[m][1], 4), _mm256_srai_epi32(a[m][2], 8)));
  } else {
    const __m256i lo = _mm256_set1_epi16(0x00FF);
    __m256i a[M][2];
    for (int m = 0; m < M; ++m) a[m][0] = a[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int L = 0; L < 8; ++L) {
      const __m256i v = load256(w + 32 * L);
      const __m256i e0 = _mm256_and_si256(v, lo), e1 = _mm256_srli_epi16(v, 8);
      for (int m = 0; m < M; ++m) {
        const int16_t* x = xa + m * stride + 32 * L;
        a[m][L & 1] = _mm256_add_epi32(a[m][L & 1], _mm256_add_epi32(_mm256_madd_epi16(e0, load256(x)),
                                                                     _mm256_madd_epi16(e1, load256(x + 16))));
      }
    }
    for (int m = 0; m < M; ++m) dots[m] = _mm256_add_epi32(a[m][0], a[m][1]);
  }
}

// y[m, n0:n1] for M rows of x.
template <int BITS, int M>
void gemv_rows(const int16_t* xa, const float* dx, const float* xsum, int64_t S, const uint8_t* q,
               const float* scale, const uint8_t* zero, int64_t n0, int64_t n1, int64_t N, float* y) {
  const int64_t row_bytes = S * 32 * BITS / 8, Kp = S * 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qn = q + n * row_bytes;
    const float* sn = scale + n * S;
    const uint8_t* zn = zero + n * S;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < S; b += 8) {
      // ~1.5 KB ahead in each stream (rows are contiguous): measured +15% over the hardware
      // prefetcher alone with both cores streaming
      const int64_t ahead = PREFETCH_BYTES / (32 * BITS) * 8;
      for (int o = 0; o < 32 * BITS; o += 64) _mm_prefetch(reinterpret_cast<const char*>(qn + (b + ahead) * 4 * BITS) + o, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(sn + b + ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(zn + b + ahead), _MM_HINT_T0);
      __m256i dots[M];
      group_dots<BITS, M>(qn + b * 4 * BITS, xa + b * 32, Kp, dots);
      const __m256 s = _mm256_loadu_ps(sn + b), z = load_u8_ps(zn + b);
      for (int m = 0; m < M; ++m) {
        const __m256 t = _mm256_fmsub_ps(_mm256_cvtepi32_ps(dots[m]), _mm256_loadu_ps(dx + m * S + b),
                                         _mm256_mul_ps(z, _mm256_loadu_ps(xsum + m * S + b)));
        acc[m] = _mm256_fmadd_ps(t, s, acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = hsum(acc[m]);
  }
}

// Rows of x in tiles of 4, 2, 1; with more than one tile, weight rows in blocks of 16 so that each
// block is read from memory once and from cache by the other tiles.
template <int BITS>
void gemv_range(int64_t M, const int16_t* xa, const float* dx, const float* xsum, int64_t S, const uint8_t* q,
                const float* scale, const uint8_t* zero, int64_t n0, int64_t n1, int64_t N, float* y) {
  const int64_t Kp = S * 32, rows = M <= 4 ? n1 - n0 : 16;
  for (int64_t nb = n0; nb < n1; nb += rows) {
    const int64_t ne = std::min(n1, nb + rows);
    for (int64_t m0 = 0; m0 < M;) {
      const int64_t left = M - m0;
      const int16_t* xm = xa + m0 * Kp;
      const float *dm = dx + m0 * S, *sm = xsum + m0 * S;
      float* ym = y + m0 * N;
      if (left >= 4) {
        gemv_rows<BITS, 4>(xm, dm, sm, S, q, scale, zero, nb, ne, N, ym);
        m0 += 4;
      } else if (left >= 2) {
        gemv_rows<BITS, 2>(xm, dm, sm, S, q, scale, zero, nb, ne, N, ym);
        m0 += 2;
      } else {
        gemv_rows<BITS, 1>(xm, dm, sm, S, q, scale, zero, nb, ne, N, ym);
        m0 += 1;
      }
    }
  }
}

// x [M, K] -> xa [M, Kp] int16 in the layout's order (within a group, the pair k = 32 j + 2 t, +1
// at int32 index 8 t + j), dx [M, S] the sub-blocks' scales, xsum [M, S]. Padding is zero.
void quantize_x(const float* x, int64_t M, int64_t K, int64_t S, int16_t* xa, float* dx, float* xsum) {
  const int64_t Kp = S * 32;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < S; ++b) {
      alignas(32) int32_t pairs[16];  // the sub-block's 32 int16 values, as 16 pairs
      float d = 0.f, total = 0.f;
      if (b * 32 < K) {
        const float* v = x + m * K + b * 32;
        __m256 f[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
          f[i] = _mm256_loadu_ps(v + 8 * i);
          amax = _mm256_max_ps(amax, _mm256_and_ps(f[i], absmask));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float big = _mm_cvtss_f32(h);
        d = big > 0.f ? big / 32767.f : 0.f;
        const __m256 inv = _mm256_set1_ps(big > 0.f ? 32767.f / big : 0.f);
        __m256i r[4];  // round to nearest even, as lrintf
        for (int i = 0; i < 4; ++i) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(f[i], inv));
        // packs interleaves 4-value pieces per 128-bit lane; the qword permute restores k order
        _mm256_store_si256(reinterpret_cast<__m256i*>(pairs), _mm256_permute4x64_epi64(_mm256_packs_epi32(r[0], r[1]), 0xD8));
        _mm256_store_si256(reinterpret_cast<__m256i*>(pairs + 8), _mm256_permute4x64_epi64(_mm256_packs_epi32(r[2], r[3]), 0xD8));
        const __m256i t = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        t4 = _mm_add_epi32(t4, _mm_unpackhi_epi64(t4, t4));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 1));
        total = static_cast<float>(_mm_cvtsi128_si32(t4));
      } else {
        std::fill(pairs, pairs + 16, 0);
      }
      int32_t* out = reinterpret_cast<int32_t*>(xa + m * Kp + (b / 8) * GROUP);
      for (int t = 0; t < 16; ++t) out[8 * t + b % 8] = pairs[t];
      dx[m * S + b] = d;
      xsum[m * S + b] = d * total;
    }
  }
}

// Contiguous, equal row ranges per thread: each core streams its own part of the weights.
template <typename F>
void split_rows(int64_t N, int64_t threads, F&& body) {
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(threads, (N + 7) / 8));
#pragma omp parallel num_threads(T)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t per = (N + nt - 1) / nt;
    const int64_t n0 = std::min(N, t * per), n1 = std::min(N, n0 + per);
    if (n0 < n1) body(n0, n1);
  }
}

struct Scratch {  // per calling thread; the x buffers are small and reused every call
  std::vector<int16_t> xa;
  std::vector<float> dx, xsum;
};

void check(const torch::Tensor& q, const torch::Tensor& scale, const torch::Tensor& zero, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(q.dtype() == torch::kUInt8 && q.is_contiguous() && q.dim() == 2, "q: contiguous uint8 [N, Kp*bits/8]");
  TORCH_CHECK(scale.dtype() == torch::kFloat32 && zero.dtype() == torch::kUInt8 && scale.is_contiguous() &&
              zero.is_contiguous() && scale.dim() == 2 && scale.size(0) == q.size(0) && zero.sizes() == scale.sizes(),
              "scale f32 / zero points uint8: contiguous [N, Kp/32]");
  TORCH_CHECK(scale.size(1) % 8 == 0 && q.size(1) * 8 == scale.size(1) * 32 * bits,
              "q and scale disagree on Kp (a multiple of 256): weights not made by pack()");
}

// exp for x <= 0 (softmax after subtracting the max): 2^n * p(r), |r| <= ln2/2, relative error ~2e-7;
// below -87 it returns 0 (exp(-87) is under f32's normal range)
inline __m256 exp_neg(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// One kv head's attention for R query rows (the query heads of its group x the query positions):
// scores over the keys (skipping keys masked for every row), softmax, the weighted sum of values.
// K and V are read once for all R rows. `bias(row, t)`: additive mask, -inf = masked.
template <typename Bias>
void attend(const float* const* qrows, int R, const float* k, int64_t k_t, const float* v, int64_t v_t, int64_t T,
            int64_t D, float scale, Bias&& bias, float* const* out, float* scores) {
  for (int64_t t = 0; t < T; ++t) {
    bool any = false;
    for (int r = 0; r < R; ++r) {
      scores[r * T + t] = bias(r, t);
      any |= scores[r * T + t] != -INFINITY;
    }
    if (!any) continue;
    const float* kt = k + t * k_t;
    for (int r = 0; r < R; ++r) {
      if (scores[r * T + t] == -INFINITY) continue;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qrows[r] + d), _mm256_loadu_ps(kt + d), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qrows[r] + d + 8), _mm256_loadu_ps(kt + d + 8), a1);
      }
      scores[r * T + t] += hsum(_mm256_add_ps(a0, a1)) * scale;
    }
  }
  for (int r = 0; r < R; ++r) {  // softmax in place; a row with every key masked attends nothing
    float* sr = scores + r * T;
    float mx = -INFINITY;
    for (int64_t t = 0; t < T; ++t) mx = std::max(mx, sr[t]);
    std::fill(out[r], out[r] + D, 0.f);
    if (mx == -INFINITY) {
      std::fill(sr, sr + T, 0.f);
      continue;
    }
    __m256 total = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= T; t += 8) {
      const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(sr + t), _mm256_set1_ps(mx)));
      _mm256_storeu_ps(sr + t, e);
      total = _mm256_add_ps(total, e);
    }
    float sum = hsum(total);
    for (; t < T; ++t) {
      sr[t] = std::exp(sr[t] - mx);
      sum += sr[t];
    }
    const float inv = 1.f / sum;
    for (t = 0; t < T; ++t) sr[t] *= inv;
  }
  for (int64_t t = 0; t < T; ++t) {
    const float* vt = v + t * v_t;
    for (int r = 0; r < R; ++r) {
      const float p = scores[r * T + t];
      if (p == 0.f) continue;
      const __m256 pv = _mm256_set1_ps(p);
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(out[r] + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(vt + d), _mm256_loadu_ps(out[r] + d)));
    }
  }
}

}  // namespace

// [K, N] values (uint8, one per element), scale [K/block, N] f32, zero [K/block, N] u8 -> the layout above.
std::vector<torch::Tensor> pack(torch::Tensor q, torch::Tensor scale, torch::Tensor zero, int64_t block, int64_t bits) {
  TORCH_CHECK(q.dtype() == torch::kUInt8 && q.dim() == 2, "q: uint8 [K, N]");
  const int64_t K = q.size(0), N = q.size(1);
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(block % 32 == 0 && K % block == 0, "block must be a multiple of 32 dividing K");
  TORCH_CHECK(scale.dtype() == torch::kFloat32 && scale.dim() == 2 && scale.size(0) == K / block && scale.size(1) == N &&
              zero.dtype() == torch::kUInt8 && zero.sizes() == scale.sizes(), "scale f32 / zero uint8 [K/block, N]");
  const int64_t Kp = (K + GROUP - 1) / GROUP * GROUP, S = Kp / 32, G = Kp / GROUP, per = block / 32;
  auto qt = torch::zeros({N, Kp}, q.options());
  qt.narrow(1, 0, K).copy_(q.t());
  // [N, G, j, t, e] (k = 32 j + 2 t + e) -> [N, G, L, j, e, i] with t = L * (values per word) + i
  const int64_t per_word = bits == 4 ? 4 : 2;
  auto v = qt.view({N, G, 8, 16 / per_word, per_word, 2}).permute({0, 1, 3, 2, 5, 4}).contiguous();
  torch::Tensor packed;
  if (bits == 4) {  // word = nibbles i = 0..3 from the low bits: byte 0 = i 0, 1; byte 1 = i 2, 3
    auto nib = v.view({N, G, 4, 16, 2, 2});
    packed = nib.select(5, 0).bitwise_or(nib.select(5, 1).bitwise_left_shift(4)).reshape({N, Kp / 2});
  } else {  // word = byte i 0, then byte i 1 (little-endian)
    packed = v.reshape({N, Kp});
  }
  auto s = torch::zeros({N, S}, scale.options());
  auto z = torch::zeros({N, S}, zero.options());
  s.narrow(1, 0, K / 32).copy_(scale.t().repeat_interleave(per, 1));
  z.narrow(1, 0, K / 32).copy_(zero.t().repeat_interleave(per, 1));
  return {packed.contiguous(), s, z};
}

// `threads`: the kernel's own OpenMP team. The runtime keeps torch's intra-op pool at one thread
// during decode (small ops lose more to fork/join than they gain) and gives the matmuls the cores.
torch::Tensor gemv(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor zero, int64_t bits,
                   int64_t threads) {
  check(q, scale, zero, bits);
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "x: contiguous f32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), S = scale.size(1);
  TORCH_CHECK(K % 32 == 0 && K <= S * 32 && S * 32 - K < GROUP, "x's K does not match the packed weights");
  thread_local Scratch scratch;
  scratch.xa.resize(M * S * 32);
  scratch.dx.resize(M * S);
  scratch.xsum.resize(M * S);
  quantize_x(x.data_ptr<float>(), M, K, S, scratch.xa.data(), scratch.dx.data(), scratch.xsum.data());
  auto y = torch::empty({M, N}, x.options());
  const int16_t* xap = scratch.xa.data();
  const float *dxp = scratch.dx.data(), *xsp = scratch.xsum.data();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const uint8_t* zp = zero.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  split_rows(N, threads, [&](int64_t n0, int64_t n1) {
    if (bits == 4) gemv_range<4>(M, xap, dxp, xsp, S, qp, sp, zp, n0, n1, N, yp);
    else gemv_range<8>(M, xap, dxp, xsp, S, qp, sp, zp, n0, n1, N, yp);
  });
  return y;
}

// W [N, K] f32 into `out` (a reusable buffer), for torch.matmul / F.linear on many rows.
torch::Tensor dequant(torch::Tensor q, torch::Tensor scale, torch::Tensor zero, int64_t K, int64_t bits,
                      torch::Tensor out, int64_t threads) {
  check(q, scale, zero, bits);
  const int64_t N = q.size(0), S = scale.size(1);
  TORCH_CHECK(K % 32 == 0 && K <= S * 32 && S * 32 - K < GROUP, "K does not match the packed weights");
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.is_contiguous() && out.numel() >= N * K, "out too small");
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const uint8_t* zp = zero.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = S * 32 * bits / 8;
  split_rows(N, threads, [&](int64_t n0, int64_t n1) {
    const __m256i lo_lanes = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), hi_lanes = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t b = 0; b < S; b += 8) {
        const __m256 s = _mm256_loadu_ps(sp + n * S + b);
        const __m256 c = _mm256_mul_ps(s, load_u8_ps(zp + n * S + b));  // scale * zp
        // word p of a weight vector belongs to sub-block p / 2: lanes of 8 floats pair up as below
        const __m256 s_lo = _mm256_permutevar8x32_ps(s, lo_lanes), s_hi = _mm256_permutevar8x32_ps(s, hi_lanes);
        const __m256 c_lo = _mm256_permutevar8x32_ps(c, lo_lanes), c_hi = _mm256_permutevar8x32_ps(c, hi_lanes);
        const uint8_t* w = qp + n * row_bytes + b * 4 * bits;
        float* o = op + n * K + b * 32;
        const int64_t subs = std::min<int64_t>(8, (K - b * 32) / 32);  // sub-blocks of this group inside K
        for (int t0 = 0; t0 < 16; t0 += 4) {
          __m256d f[2][4];  // the floats multiply-adds t0..t0+3 see, lanes j 0-3 | 4-7, as pairs (one double each)
          for (int i = 0; i < 4; ++i) {
            const int t = t0 + i;
            __m256i e;  // the weights multiply-add t sees, as 16 int16 words
            if (bits == 4) {
              e = _mm256_and_si256(_mm256_srli_epi16(load256(w + 32 * (t / 4)), 4 * (t % 4)), _mm256_set1_epi16(0x000F));
            } else {
              e = _mm256_and_si256(_mm256_srli_epi16(load256(w + 32 * (t / 2)), 8 * (t % 2)), _mm256_set1_epi16(0x00FF));
            }
            f[0][i] = _mm256_castps_pd(_mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(e))), s_lo, c_lo));
            f[1][i] = _mm256_castps_pd(_mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(e, 1))), s_hi, c_hi));
          }
          for (int h = 0; h < 2; ++h) {  // 4x4 transpose of pairs: sub-block j's k = 32 j + 2 t0 .. +7 in one store
            const __m256d u0 = _mm256_unpacklo_pd(f[h][0], f[h][1]), u1 = _mm256_unpackhi_pd(f[h][0], f[h][1]);
            const __m256d u2 = _mm256_unpacklo_pd(f[h][2], f[h][3]), u3 = _mm256_unpackhi_pd(f[h][2], f[h][3]);
            const __m256d r[4] = {_mm256_permute2f128_pd(u0, u2, 0x20), _mm256_permute2f128_pd(u1, u3, 0x20),
                                  _mm256_permute2f128_pd(u0, u2, 0x31), _mm256_permute2f128_pd(u1, u3, 0x31)};
            for (int j = 0; j < 4 && 4 * h + j < subs; ++j)
              _mm256_storeu_ps(o + 32 * (4 * h + j) + 2 * t0, _mm256_castpd_ps(r[j]));
          }
        }
      }
    }
  });
  return out.narrow(0, 0, N * K).view({N, K});
}

// Attention for a few query positions (decode) with grouped kv heads, f32:
// out = softmax(q k^T * scale + mask) v. q [B, Hq, S, D]; k, v [B, Hkv, T, D] (any strides, D
// contiguous: a view into a preallocated cache); mask: none, bool (true = attend) or additive f32,
// 4-D and broadcastable to [B, Hq, S, T]. One task per (batch, kv head) over the kernels' team;
// keys masked for every query row are not read (the unwritten tail of a static cache).
torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                        double scale, int64_t threads) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v: [B, H, S|T, D]");
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k.dtype() == torch::kFloat32 && v.dtype() == torch::kFloat32, "f32 only");
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), D = q.size(3), Hkv = k.size(1), T = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == T && k.size(3) == D &&
              v.size(3) == D && Hkv > 0 && Hq % Hkv == 0, "q, k, v shapes disagree");
  TORCH_CHECK(D % 16 == 0 && q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "head_dim must be a multiple of 16 and contiguous");
  torch::Tensor m;
  if (mask.has_value() && mask->defined()) {
    m = *mask;
    TORCH_CHECK(m.dim() == 4 && (m.dtype() == torch::kBool || m.dtype() == torch::kFloat32), "mask: 4-D bool or f32");
    const int64_t full[4] = {B, Hq, S, T};
    for (int i = 0; i < 4; ++i) TORCH_CHECK(m.size(i) == 1 || m.size(i) == full[i], "mask does not broadcast");
  }
  const int64_t group = Hq / Hkv, R = group * S;
  auto out = torch::empty({B, Hq, S, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool has_mask = m.defined(), is_bool = has_mask && m.dtype() == torch::kBool;
  const void* mp = has_mask ? m.data_ptr() : nullptr;
  int64_t ms[4] = {0, 0, 0, 0};
  for (int i = 0; has_mask && i < 4; ++i) ms[i] = m.size(i) == 1 ? 0 : m.stride(i);
  const int64_t tasks = B * Hkv;
  const int64_t team = std::max<int64_t>(1, std::min(threads, tasks));
#pragma omp parallel num_threads(team)
  {
    std::vector<float> scores(R * T);
    std::vector<const float*> qrows(R);
    std::vector<float*> orows(R);
    std::vector<int64_t> mrow(R);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t hq = h * group + r / S, sq = r % S;
        qrows[r] = qp + b * q.stride(0) + hq * q.stride(1) + sq * q.stride(2);
        orows[r] = op + ((b * Hq + hq) * S + sq) * D;
        mrow[r] = b * ms[0] + hq * ms[1] + sq * ms[2];
      }
      const float* kb = kp + b * k.stride(0) + h * k.stride(1);
      const float* vb = vp + b * v.stride(0) + h * v.stride(1);
      const float sc = static_cast<float>(scale);
      if (!has_mask) {
        attend(qrows.data(), R, kb, k.stride(2), vb, v.stride(2), T, D, sc, [](int, int64_t) { return 0.f; },
               orows.data(), scores.data());
      } else if (is_bool) {
        const bool* mb = static_cast<const bool*>(mp);
        attend(qrows.data(), R, kb, k.stride(2), vb, v.stride(2), T, D, sc,
               [&](int r, int64_t t) { return mb[mrow[r] + t * ms[3]] ? 0.f : -INFINITY; }, orows.data(), scores.data());
      } else {
        const float* mf = static_cast<const float*>(mp);
        attend(qrows.data(), R, kb, k.stride(2), vb, v.stride(2), T, D, sc,
               [&](int r, int64_t t) { return mf[mrow[r] + t * ms[3]]; }, orows.data(), scores.data());
      }
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "[K, N] blocked low-bit weights to the kernels' layout");
  m.def("gemv", &gemv, "low-bit weight-only GEMV for a few rows of x");
  m.def("dequant", &dequant, "low-bit weights to f32 [N, K]");
  m.def("attention", &attention, "grouped-query attention for a few query positions");
}
