// Weight-only low-bit matmul kernels for x86 CPUs with AVX2 + FMA (fuselm runtime, torch backend).
//
// torch's own CPU kernels (_weight_int4pack_mm_for_cpu, _weight_int8pack_mm) are scalar without
// AVX-512 and 10-20x slower than an f32 GEMV on AVX2 machines, so fuselm ships these. They are
// built once per machine by torch.utils.cpp_extension (runtime_metal/backends/torch_quant.py).
//
// Weights are W[n, k] = q[n, k] * scale[n, g] + zs[n, g] (zs = -zero_point * scale, g = k / block),
// output channels n in rows, the reduction dim k contiguous.
//   4 bits: per 32 consecutive k, 16 bytes; byte j holds q[k0 + j] (low nibble) and q[k0 + 16 + j]
//           (high nibble), so one load yields k0..15 and k16..31 with a mask and a shift.
//   8 bits: one byte per value.
// gemv: y[m, n] = sum_g scale[n, g] * (q[n, g-block] . x[m, g-block]) + zs[n, g] * sum(x[m, g-block]),
// for a few rows of x (decode). dequant: W as f32 for a BLAS GEMM (prefill).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 u8_to_ps(__m128i bytes8) {  // the low 8 bytes of bytes8 as 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8));
}

// 32 weights of one 4-bit sub-block as four vectors of 8 floats (k0..7, k8..15, k16..23, k24..31).
inline void load32_q4(const uint8_t* p, __m256 w[4]) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i lo = _mm_and_si128(bytes, mask);
  __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  w[0] = u8_to_ps(lo);
  w[1] = u8_to_ps(_mm_srli_si128(lo, 8));
  w[2] = u8_to_ps(hi);
  w[3] = u8_to_ps(_mm_srli_si128(hi, 8));
}

inline void load32_q8(const uint8_t* p, __m256 w[4]) {
  for (int i = 0; i < 4; ++i)
    w[i] = u8_to_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i)));
}

template <int BITS, int M>
void gemv_rows(const float* x, int64_t K, const uint8_t* q, const float* scale, const float* zs,
               const float* xsum, int64_t block, int64_t n0, int64_t n1, int64_t N, float* y) {
  // independent accumulators per row of x: one FMA chain would be latency-bound (4 cycles each)
  constexpr int A = M == 1 ? 4 : (M == 2 ? 2 : 1);
  const int64_t G = K / block;
  const int64_t row_bytes = K * BITS / 8;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qn = q + n * row_bytes;
    const float* sn = scale + n * G;
    const float* zn = zs + n * G;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    float zterm[M] = {0};
    for (int64_t g = 0; g < G; ++g) {
      __m256 gacc[M][A];
      for (int m = 0; m < M; ++m)
        for (int a = 0; a < A; ++a) gacc[m][a] = _mm256_setzero_ps();
      for (int64_t k0 = g * block; k0 < (g + 1) * block; k0 += 32) {
        __m256 w[4];
        if (BITS == 4) load32_q4(qn + k0 / 2, w); else load32_q8(qn + k0, w);
        for (int m = 0; m < M; ++m) {
          const float* xm = x + m * K + k0;
          for (int i = 0; i < 4; ++i)
            gacc[m][i % A] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xm + 8 * i), gacc[m][i % A]);
        }
      }
      const __m256 s = _mm256_set1_ps(sn[g]);
      for (int m = 0; m < M; ++m) {
        __m256 sum = gacc[m][0];
        for (int a = 1; a < A; ++a) sum = _mm256_add_ps(sum, gacc[m][a]);
        acc[m] = _mm256_fmadd_ps(sum, s, acc[m]);
        zterm[m] += zn[g] * xsum[m * G + g];
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = hsum(acc[m]) + zterm[m];
  }
}

template <int BITS>
void gemv_dispatch(int64_t M, const float* x, int64_t K, const uint8_t* q, const float* scale, const float* zs,
                   const float* xsum, int64_t block, int64_t n0, int64_t n1, int64_t N, float* y) {
  const int64_t G = K / block;
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int64_t mm = std::min<int64_t>(4, M - m0);
    const float* xm = x + m0 * K;
    const float* xs = xsum + m0 * G;
    float* ym = y + m0 * N;
    switch (mm) {
      case 1: gemv_rows<BITS, 1>(xm, K, q, scale, zs, xs, block, n0, n1, N, ym); break;
      case 2: gemv_rows<BITS, 2>(xm, K, q, scale, zs, xs, block, n0, n1, N, ym); break;
      case 3: gemv_rows<BITS, 3>(xm, K, q, scale, zs, xs, block, n0, n1, N, ym); break;
      default: gemv_rows<BITS, 4>(xm, K, q, scale, zs, xs, block, n0, n1, N, ym); break;
    }
  }
}

void check(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale, const torch::Tensor& zs,
           int64_t block, int64_t bits) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "x: contiguous f32 [M, K]");
  TORCH_CHECK(q.dtype() == torch::kUInt8 && q.is_contiguous() && q.dim() == 2, "q: contiguous uint8 [N, K*bits/8]");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(block % 32 == 0 && x.size(1) % block == 0, "block must be a multiple of 32 dividing K");
  TORCH_CHECK(q.size(1) * 8 == x.size(1) * bits, "q and x disagree on K");
  TORCH_CHECK(scale.dtype() == torch::kFloat32 && zs.dtype() == torch::kFloat32 && scale.is_contiguous() &&
              zs.is_contiguous() && scale.size(0) == q.size(0) && scale.size(1) == x.size(1) / block,
              "scale/zs: contiguous f32 [N, K/block]");
}

}  // namespace

torch::Tensor gemv(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor zs, int64_t block,
                   int64_t bits) {
  check(x, q, scale, zs, block, bits);
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), G = K / block;
  auto xsum = x.view({M, G, block}).sum(2).contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* zp = zs.data_ptr<float>();
  const float* xsp = xsum.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    if (bits == 4) gemv_dispatch<4>(M, xp, K, qp, sp, zp, xsp, block, n0, n1, N, yp);
    else gemv_dispatch<8>(M, xp, K, qp, sp, zp, xsp, block, n0, n1, N, yp);
  });
  return y;
}

// W [N, K] f32 into `out` (a reusable buffer), for torch.matmul / F.linear on many rows.
torch::Tensor dequant(torch::Tensor q, torch::Tensor scale, torch::Tensor zs, int64_t block, int64_t bits,
                      torch::Tensor out) {
  const int64_t N = q.size(0), K = q.size(1) * 8 / bits, G = K / block;
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.is_contiguous() && out.numel() >= N * K, "out too small");
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* zp = zs.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t g = 0; g < G; ++g) {
        const __m256 s = _mm256_set1_ps(sp[n * G + g]), z = _mm256_set1_ps(zp[n * G + g]);
        for (int64_t k0 = g * block; k0 < (g + 1) * block; k0 += 32) {
          __m256 w[4];
          if (bits == 4) load32_q4(qp + n * (K / 2) + k0 / 2, w); else load32_q8(qp + n * K + k0, w);
          float* o = op + n * K + k0;
          for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(w[i], s, z));
        }
      }
    }
  });
  return out.narrow(0, 0, N * K).view({N, K});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "low-bit weight-only GEMV for a few rows of x");
  m.def("dequant", &dequant, "low-bit weights to f32 [N, K]");
}
