// Weight-only low-bit matmul kernels for x86 CPUs with AVX2 + FMA (fuselm runtime, torch backend).
//
// torch's own CPU kernels (_weight_int4pack_mm_for_cpu, _weight_int8pack_mm) are scalar without
// AVX-512 and 10-20x slower than an f32 GEMV on AVX2 machines, so fuselm ships these. They are
// built once per machine by torch.utils.cpp_extension (runtime_metal/backends/torch_quant.py).
//
// Weights are W[n, k] = (q[n, k] - zp[n, g]) * scale[n, g] (g = k / block; zp uint8, scale f32),
// output channels n in rows, the reduction dim k contiguous.
//   4 bits: per 32 consecutive k, 16 bytes; byte j holds q[k0 + j] (low nibble) and q[k0 + 16 + j]
//           (high nibble), so one load yields k0..15 and k16..31 with a mask and a shift.
//   8 bits: one byte per value.
// gemv: y[m, n] = sum_g scale[n, g] * (q[n, g-block] . x[m, g-block] - zp[n, g] * sum(x[m, g-block])),
// for a few rows of x (decode), x rounded to int16 per 32 values. dequant: W as f32 for a BLAS GEMM
// (prefill, exact f32 activations).

#include <torch/extension.h>
#include <omp.h>
#include <cmath>
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

// 32 weights as two vectors of 16 int16 (k0..15, k16..31).
inline void load32_i16(const uint8_t* p, int bits, __m256i w[2]) {
  if (bits == 4) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    w[0] = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, mask));
    w[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
  } else {
    w[0] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w[1] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
}

// The decode GEMV. x is first rounded to int16 per 32 values (scale = max|x| / 32767: a relative
// error of at most 1.5e-5 of the block's largest value, 250x finer than bf16), so q . x runs as
// integer multiply-adds (vpmaddwd: 16 products per instruction) and only each 32-block's sum is
// scaled in float.
template <int BITS, int M>
void gemv_rows(const int16_t* xq, const float* xs, int64_t K, const uint8_t* q, const float* scale,
               const uint8_t* zp, const float* xsum, int64_t block, int64_t n0, int64_t n1, int64_t N, float* y) {
  const int64_t G = K / block, B32 = K / 32;
  const int64_t row_bytes = K * BITS / 8;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qn = q + n * row_bytes;
    const float* sn = scale + n * G;
    const uint8_t* zn = zp + n * G;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    float zterm[M] = {0};
    for (int64_t g = 0; g < G; ++g) {
      __m256 gacc[M];
      for (int m = 0; m < M; ++m) gacc[m] = _mm256_setzero_ps();
      for (int64_t k0 = g * block; k0 < (g + 1) * block; k0 += 32) {
        __m256i w[2];
        load32_i16(qn + k0 * BITS / 8, BITS, w);
        for (int m = 0; m < M; ++m) {
          const int16_t* xm = xq + m * K + k0;
          __m256i d = _mm256_add_epi32(
              _mm256_madd_epi16(w[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm))),
              _mm256_madd_epi16(w[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + 16))));
          gacc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(xs[m * B32 + k0 / 32]), gacc[m]);
        }
      }
      const __m256 s = _mm256_set1_ps(sn[g]);
      for (int m = 0; m < M; ++m) {
        acc[m] = _mm256_fmadd_ps(gacc[m], s, acc[m]);
        zterm[m] += sn[g] * static_cast<float>(zn[g]) * xsum[m * G + g];
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = hsum(acc[m]) - zterm[m];
  }
}

template <int BITS>
void gemv_dispatch(int64_t M, const int16_t* xq, const float* xs, int64_t K, const uint8_t* q, const float* scale,
                   const uint8_t* zero, const float* xsum, int64_t block, int64_t n0, int64_t n1, int64_t N, float* y) {
  const int64_t G = K / block, B32 = K / 32;
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int64_t mm = std::min<int64_t>(4, M - m0);
    const int16_t* xm = xq + m0 * K;
    const float* xsm = xs + m0 * B32;
    const float* xsu = xsum + m0 * G;
    float* ym = y + m0 * N;
    switch (mm) {
      case 1: gemv_rows<BITS, 1>(xm, xsm, K, q, scale, zero, xsu, block, n0, n1, N, ym); break;
      case 2: gemv_rows<BITS, 2>(xm, xsm, K, q, scale, zero, xsu, block, n0, n1, N, ym); break;
      case 3: gemv_rows<BITS, 3>(xm, xsm, K, q, scale, zero, xsu, block, n0, n1, N, ym); break;
      default: gemv_rows<BITS, 4>(xm, xsm, K, q, scale, zero, xsu, block, n0, n1, N, ym); break;
    }
  }
}

// x [M, K] -> int16 values and one float scale per 32 (x ~= xq * xs), and per weight block the sum
// of the rounded x: the zero-point term must see the same x as q . x, or the error scales with q
// instead of with q - zero_point.
void quantize_x(const float* x, int64_t M, int64_t K, int64_t block, int16_t* xq, float* xs, float* xsum) {
  for (int64_t b = 0; b < M * K / 32; ++b) {
    const float* v = x + b * 32;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float scale = amax > 0.f ? amax / 32767.f : 1.f;
    const float inv = 1.f / scale;
    xs[b] = scale;
    int32_t total = 0;
    for (int i = 0; i < 32; ++i) {
      xq[b * 32 + i] = static_cast<int16_t>(std::lrintf(v[i] * inv));
      total += xq[b * 32 + i];
    }
    const int64_t g = (b * 32) / block;  // blocks never straddle rows: K % block == 0
    if ((b * 32) % block == 0) xsum[g] = 0.f;
    xsum[g] += scale * static_cast<float>(total);
  }
}

void check(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale, const torch::Tensor& zero,
           int64_t block, int64_t bits) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "x: contiguous f32 [M, K]");
  TORCH_CHECK(q.dtype() == torch::kUInt8 && q.is_contiguous() && q.dim() == 2, "q: contiguous uint8 [N, K*bits/8]");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(block % 32 == 0 && x.size(1) % block == 0, "block must be a multiple of 32 dividing K");
  TORCH_CHECK(q.size(1) * 8 == x.size(1) * bits, "q and x disagree on K");
  TORCH_CHECK(scale.dtype() == torch::kFloat32 && zero.dtype() == torch::kUInt8 && scale.is_contiguous() &&
              zero.is_contiguous() && scale.size(0) == q.size(0) && scale.size(1) == x.size(1) / block &&
              zero.sizes() == scale.sizes(), "scale f32 / zero points uint8: contiguous [N, K/block]");
}

}  // namespace

// `threads`: the kernel's own OpenMP team. The runtime keeps torch's intra-op pool at one thread
// during decode (small ops lose more to fork/join than they gain) and gives the matmuls the cores.
torch::Tensor gemv(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor zero, int64_t block,
                   int64_t bits, int64_t threads) {
  check(x, q, scale, zero, block, bits);
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), G = K / block;
  auto xsum = torch::empty({M, G}, x.options());
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt16));
  auto xs = torch::empty({M, K / 32}, x.options());
  quantize_x(x.data_ptr<float>(), M, K, block, xq.data_ptr<int16_t>(), xs.data_ptr<float>(), xsum.data_ptr<float>());
  auto y = torch::empty({M, N}, x.options());
  const int16_t* xqp = xq.data_ptr<int16_t>();
  const float* xsp = xs.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const uint8_t* zp = zero.data_ptr<uint8_t>();
  const float* xsump = xsum.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t chunk = 32, chunks = (N + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk);
    if (bits == 4) gemv_dispatch<4>(M, xqp, xsp, K, qp, sp, zp, xsump, block, n0, n1, N, yp);
    else gemv_dispatch<8>(M, xqp, xsp, K, qp, sp, zp, xsump, block, n0, n1, N, yp);
  }
  return y;
}

// W [N, K] f32 into `out` (a reusable buffer), for torch.matmul / F.linear on many rows.
torch::Tensor dequant(torch::Tensor q, torch::Tensor scale, torch::Tensor zero, int64_t block, int64_t bits,
                      torch::Tensor out, int64_t threads) {
  const int64_t N = q.size(0), K = q.size(1) * 8 / bits, G = K / block;
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.is_contiguous() && out.numel() >= N * K, "out too small");
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const uint8_t* zp = zero.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    {
      for (int64_t g = 0; g < G; ++g) {
        const __m256 s = _mm256_set1_ps(sp[n * G + g]), z = _mm256_set1_ps(-sp[n * G + g] * zp[n * G + g]);
        for (int64_t k0 = g * block; k0 < (g + 1) * block; k0 += 32) {
          __m256 w[4];
          if (bits == 4) load32_q4(qp + n * (K / 2) + k0 / 2, w); else load32_q8(qp + n * K + k0, w);
          float* o = op + n * K + k0;
          for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(w[i], s, z));
        }
      }
    }
  }
  return out.narrow(0, 0, N * K).view({N, K});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "low-bit weight-only GEMV for a few rows of x");
  m.def("dequant", &dequant, "low-bit weights to f32 [N, K]");
}
