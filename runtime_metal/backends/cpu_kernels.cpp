// Weight-only low-bit matmul kernels for x86 CPUs (fuselm runtime, torch backend), one build for
// every x86-64 CPU: the translation unit is compiled for the baseline (SSE2) and each instruction
// set's kernels carry their own `#pragma GCC target`; `isa_supported` (cpuid through
// __builtin_cpu_supports, which also checks that the OS saves the AVX / AVX-512 registers) tells the
// caller which it may pass. ISAs: 0 scalar (any CPU), 1 AVX2 + FMA, 2 AVX-512 VNNI (F/BW/VL + VNNI;
// an AVX-512 CPU without VNNI runs the AVX2 kernels).
//
// torch's own CPU kernels (_weight_int4pack_mm_for_cpu, _weight_int8pack_mm) are scalar without
// AVX-512 and 10-20x slower than an f32 GEMV on AVX2 machines, so fuselm ships these. They are
// built once per machine (runtime_metal/backends/kernel_build.py: at install by scripts/setup.sh).
//
// Weights are W[n, k] = (q[n, k] - zp[n, b]) * scale[n, b] (b = k / block; zp uint8, scale f32),
// output channels n in rows, the reduction dim k contiguous. k is cut in groups of 256 = 8
// sub-blocks of 32 (j = 0..7), and every kernel keeps sub-block j in 32-bit lane j of its vectors:
// lane-wise sums leave the 8 sub-blocks' integer dot products in one vector, and three vector ops
// apply their scales, zero points and x scales: no horizontal sums, no broadcasts.
//
// Layout per row, per group (rows padded with q = 0, scale = 0 to whole groups: Kp):
//   8 bits: 8 vectors of 32 bytes (t = 0..7): byte 4 j + c of vector t = q[k = 32 j + 4 t + c].
//   4 bits: 4 vectors (L = 0..3): byte 4 j + c of vector L holds q[32 j + 8 L + c] in its low nibble
//           and q[32 j + 8 L + 4 + c] in its high nibble.
//   scale [N, Kp/32] f32 and zp [N, Kp/32] u8, one per sub-block (blocks of 64+ repeat theirs).
// x is quantized per call, per sub-block of 32 (dx = max|x| / qmax), and arranged so that each
// kernel's loads meet the weights they multiply (`arrangement`):
//   int8 (qmax 127, the seed's Step 2 / llama.cpp's q4_0 x q8_0): AVX2 vpmaddubsw (u8 weights x s8 x,
//     pairs summed to int16; 8 products of 4-bit weights per int16 stay under 2^15, 8-bit weights go
//     as two nibbles) then vpmaddwd by ones; AVX-512 VNNI vpdpbusd (4 u8 x s8 products straight into
//     int32). 1/254 of a sub-block's largest |x| per value: what onnxruntime's accuracy level 4 does.
//   int16 (qmax 32767, AVX2 vpmaddwd on weights unpacked to 16-bit words): 1/65534, 250x finer than
//     bf16; for f32-faithful results (validation).
//   y[m, n] = sum_b scale[n, b] * (dx[m, b] * (q[n, b] . xq[m, b]) - zp[n, b] * xsum[m, b])
// with xsum = dx * sum of the rounded x of the sub-block: the zero-point term sees the same x as
// q . x, so the rounding error scales with q - zp, not with q. The same kernel runs prefill (many
// rows of x) as an integer GEMM; `dequant` gives W as f32 for a BLAS GEMM where int16 is asked.

#include <torch/extension.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <vector>
#include <immintrin.h>

namespace {

constexpr int64_t GROUP = 256;  // k per group of 8 sub-blocks of 32
constexpr int64_t PREFETCH_BYTES = 1536;
constexpr int64_t MCHUNK = 64;  // rows of x per pass over the weights (GEMM): their arranged x stays in L2
enum Isa : int64_t { SCALAR = 0, AVX2 = 1, AVX512VNNI = 2 };

bool isa_supported(int64_t isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  switch (isa) {
    case SCALAR: return true;
    case AVX2: return avx2;
    case AVX512VNNI:
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    default: return false;
  }
}

// Where x[k] (k within a group) goes in the arranged x each kernel reads (-1: natural order).
struct Arrangements {
  int16_t i8[GROUP], i8_512_4bit[GROUP], i16_4bit[GROUP], i16_8bit[GROUP];
  Arrangements() {
    // the AVX-512 4-bit kernel reads x vectors (32 bytes) t in the order 0 2 1 3 4 6 5 7: a 64-byte
    // load of weights holds vectors L and L + 1, whose low nibbles meet x vectors 2 L and 2 L + 2
    const int slot512[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    for (int j = 0; j < 8; ++j) {
      for (int t = 0; t < 8; ++t) {
        for (int c = 0; c < 4; ++c) {
          const int k = 32 * j + 4 * t + c;
          i8[k] = 32 * t + 4 * j + c;
          i8_512_4bit[k] = 32 * slot512[t] + 4 * j + c;
          // int16 words (j, h) = bytes 4 j + 2 h, + 1; the kernel masks word nibble / byte i of every word
          // in place and multiplies it with 16 x values (index 2 j + h) at 16 i past the vector's x
          const int h = c / 2, i = c % 2;
          i16_8bit[k] = 32 * t + 16 * i + 2 * j + h;
        }
      }
      for (int L = 0; L < 4; ++L) {
        for (int o = 0; o < 8; ++o) {  // k = 32 j + 8 L + o: nibble (o >= 4) of byte o % 4
          const int r = o % 4, h = r / 2, i = 2 * (r % 2) + (o >= 4);
          i16_4bit[32 * j + 8 * L + o] = 64 * L + 16 * i + 2 * j + h;
        }
      }
    }
  }
};

const int16_t* arrangement(int64_t isa, int64_t act_bits, int64_t bits) {
  static const Arrangements a;
  if (isa == SCALAR) return nullptr;
  if (act_bits == 16) return bits == 4 ? a.i16_4bit : a.i16_8bit;
  return isa == AVX512VNNI && bits == 4 ? a.i8_512_4bit : a.i8;
}

// The group's 256 weights (packed, `bits`) in k order.
void unpack_group(const uint8_t* w, int64_t bits, int32_t* q) {
  for (int j = 0; j < 8; ++j) {
    for (int o = 0; o < 32; ++o) {
      if (bits == 8) {
        q[32 * j + o] = w[32 * (o / 4) + 4 * j + o % 4];
      } else {
        const uint8_t v = w[32 * (o / 8) + 4 * j + o % 4];
        q[32 * j + o] = o % 8 >= 4 ? v >> 4 : v & 15;
      }
    }
  }
}

// x [M, K] -> xa [M, Kp] (int8 or int16, arranged by `perm`), dx [M, S] the sub-blocks' scales,
// xsum [M, S]; padding zero. Rounds to nearest even (as np.rint): adding and removing 1.5 * 2^23.
template <typename XT>
void quantize_x(const float* x, int64_t M, int64_t K, int64_t S, const int16_t* perm, XT* xa, float* dx, float* xsum,
                int64_t threads) {
  const int64_t Kp = S * 32;
  const float qmax = sizeof(XT) == 1 ? 127.f : 32767.f, magic = 12582912.f;
#pragma omp parallel for num_threads(threads) schedule(static) if (M >= 16)
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < S; ++b) {
      XT* out = xa + m * Kp + (b / 8) * GROUP;
      const int64_t j = b % 8;
      float r[32], big = 0.f, total = 0.f;
      if (b * 32 < K) {
        const float* v = x + m * K + b * 32;
        for (int o = 0; o < 32; ++o) big = std::max(big, std::fabs(v[o]));
        const float inv = big > 0.f ? qmax / big : 0.f;
        for (int o = 0; o < 32; ++o) r[o] = (v[o] * inv + magic) - magic;
      } else {
        std::fill(r, r + 32, 0.f);
      }
      for (int o = 0; o < 32; ++o) {
        total += r[o];
        out[perm ? perm[32 * j + o] : 32 * j + o] = static_cast<XT>(r[o]);
      }
      const float d = big > 0.f ? big / qmax : 0.f;
      dx[m * S + b] = d;
      xsum[m * S + b] = d * total;
    }
  }
}

// ---- scalar: any CPU (and the layout's reference) ----------------------------------------------

template <typename XT>
void gemv_scalar(int64_t bits, int64_t M, const XT* xq, const float* dx, const float* xsum, int64_t S,
                 const uint8_t* q, const float* scale, const uint8_t* zero, int64_t n0, int64_t n1, int64_t N,
                 float* y) {
  const int64_t Kp = S * 32, row_bytes = Kp * bits / 8;
  std::vector<float> acc(M);
  int32_t w[GROUP];
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t g = 0; g < S / 8; ++g) {
      unpack_group(q + n * row_bytes + g * GROUP * bits / 8, bits, w);
      for (int64_t m = 0; m < M; ++m) {
        const XT* xm = xq + m * Kp + g * GROUP;
        for (int j = 0; j < 8; ++j) {
          int32_t dot = 0;
          for (int o = 0; o < 32; ++o) dot += w[32 * j + o] * static_cast<int32_t>(xm[32 * j + o]);
          const int64_t b = 8 * g + j;
          acc[m] += scale[n * S + b] * (static_cast<float>(dot) * dx[m * S + b] - zero[n * S + b] * xsum[m * S + b]);
        }
      }
    }
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = acc[m];
  }
}

void dequant_scalar(int64_t bits, const uint8_t* qp, const float* sp, const uint8_t* zp, int64_t S, int64_t K,
                    int64_t n0, int64_t n1, float* op) {
  const int64_t row_bytes = S * 32 * bits / 8;
  int32_t w[GROUP];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t g = 0; g < S / 8; ++g) {
      unpack_group(qp + n * row_bytes + g * GROUP * bits / 8, bits, w);
      for (int64_t k = 0; k < GROUP && g * GROUP + k < K; ++k) {
        const int64_t b = 8 * g + k / 32;
        op[n * K + g * GROUP + k] = w[k] * sp[n * S + b] - sp[n * S + b] * zp[n * S + b];
      }
    }
  }
}

}  // namespace

// ---- AVX2 + FMA ---------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {

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

// int16 x: the weights unpacked in place to 16-bit words (4 bits: nibbles 1 and 2 masked where they
// are, 16x and 256x the value: the sums are shifted back, exactly; nibble 3 shifted down), vpmaddwd.
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

// int8 x: vpmaddubsw (u8 nibbles x s8 x, pairs summed to int16) summed in int16 over the group
// (|sum| <= 8 * 2 * 15 * 127 = 30480 < 2^15), then vpmaddwd by ones: one int32 per sub-block.
// 8-bit weights go as two nibbles (a whole byte x 127 x 2 would saturate int16).
template <int BITS, int M>
inline void group_dots(const uint8_t* w, const int8_t* xa, int64_t stride, __m256i* dots) {
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  if (BITS == 4) {
    __m256i a[M];
    for (int m = 0; m < M; ++m) a[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int L = 0; L < 4; ++L) {
      const __m256i v = load256(w + 32 * L);
      const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
      for (int m = 0; m < M; ++m) {
        const int8_t* x = xa + m * stride + 64 * L;
        a[m] = _mm256_add_epi16(a[m], _mm256_add_epi16(_mm256_maddubs_epi16(lo, load256(x)),
                                                       _mm256_maddubs_epi16(hi, load256(x + 32))));
      }
    }
    for (int m = 0; m < M; ++m) dots[m] = _mm256_madd_epi16(a[m], ones);
  } else {
    __m256i a[M][2];  // low nibbles | high nibbles
    for (int m = 0; m < M; ++m) a[m][0] = a[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m256i v = load256(w + 32 * t);
      const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
      for (int m = 0; m < M; ++m) {
        const __m256i x = load256(xa + m * stride + 32 * t);
        a[m][0] = _mm256_add_epi16(a[m][0], _mm256_maddubs_epi16(lo, x));
        a[m][1] = _mm256_add_epi16(a[m][1], _mm256_maddubs_epi16(hi, x));
      }
    }
    for (int m = 0; m < M; ++m)
      dots[m] = _mm256_add_epi32(_mm256_madd_epi16(a[m][0], ones), _mm256_slli_epi32(_mm256_madd_epi16(a[m][1], ones), 4));
  }
}

#include "cpu_kernels_gemv.inc"

// W rows n0..n1 as f32 [N, K] (k order) from the layout.
void dequant_rows(int64_t bits, const uint8_t* qp, const float* sp, const uint8_t* zp, int64_t S, int64_t K,
                  int64_t n0, int64_t n1, float* op) {
  const int64_t row_bytes = S * 32 * bits / 8;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t b = 0; b < S; b += 8) {
      const uint8_t* w = qp + n * row_bytes + b * 4 * bits;
      float* o = op + n * K + b * 32;
      const int64_t subs = std::min<int64_t>(8, (K - b * 32) / 32);  // sub-blocks of this group inside K
      for (int L = 0; L < 4; ++L) {
        // two vectors whose lanes j hold k = 32 j + 8 L + 0..3 and + 4..7
        __m256i lo, hi;
        if (bits == 4) {
          const __m256i v = load256(w + 32 * L);
          lo = _mm256_and_si256(v, nib);
          hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        } else {
          lo = load256(w + 64 * L);
          hi = load256(w + 64 * L + 32);
        }
        // dwords interleaved per 128-bit half: 8 bytes = sub-block j's k 8 L .. 8 L + 7, for j = 0 1 | 4 5, 2 3 | 6 7
        const __m256i u0 = _mm256_unpacklo_epi32(lo, hi), u1 = _mm256_unpackhi_epi32(lo, hi);
        const __m128i pieces[4] = {_mm256_castsi256_si128(u0), _mm256_castsi256_si128(u1),
                                   _mm256_extracti128_si256(u0, 1), _mm256_extracti128_si256(u1, 1)};
        for (int p = 0; p < 4; ++p) {
          for (int h = 0; h < 2; ++h) {
            const int j = 2 * p + h;
            if (j >= subs) continue;
            const __m128i bytes = h ? _mm_srli_si128(pieces[p], 8) : pieces[p];
            const float s = sp[n * S + b + j];
            const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
            _mm256_storeu_ps(o + 32 * j + 8 * L, _mm256_fmsub_ps(f, _mm256_set1_ps(s), _mm256_set1_ps(s * zp[n * S + b + j])));
          }
        }
      }
    }
  }
}

}  // namespace avx2
#pragma GCC pop_options

// ---- AVX-512 VNNI: the int8 kernel with 512-bit vectors (two weight vectors per load) ----------
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")
namespace avx512 {
using avx2::hsum;
using avx2::load_u8_ps;

// vpdpbusd: 4 u8 weights x 4 s8 x summed into each int32 lane (no int16 step, so 8-bit weights go
// whole). Lanes 0-7 and 8-15 hold the same 8 sub-blocks (two weight vectors); summed at the end.
template <int BITS, int M>
inline void group_dots(const uint8_t* w, const int8_t* xa, int64_t stride, __m256i* dots) {
  __m512i a[M];
  for (int m = 0; m < M; ++m) a[m] = _mm512_setzero_si512();
  if (BITS == 4) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (int P = 0; P < 2; ++P) {
      const __m512i v = _mm512_loadu_si512(w + 64 * P);
      const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      for (int m = 0; m < M; ++m) {
        const int8_t* x = xa + m * stride + 128 * P;
        a[m] = _mm512_dpbusd_epi32(a[m], lo, _mm512_loadu_si512(x));
        a[m] = _mm512_dpbusd_epi32(a[m], hi, _mm512_loadu_si512(x + 64));
      }
    }
  } else {
    for (int P = 0; P < 4; ++P) {
      const __m512i v = _mm512_loadu_si512(w + 64 * P);
      for (int m = 0; m < M; ++m) a[m] = _mm512_dpbusd_epi32(a[m], v, _mm512_loadu_si512(xa + m * stride + 64 * P));
    }
  }
  for (int m = 0; m < M; ++m) dots[m] = _mm256_add_epi32(_mm512_castsi512_si256(a[m]), _mm512_extracti64x4_epi64(a[m], 1));
}

#include "cpu_kernels_gemv.inc"

}  // namespace avx512
#pragma GCC pop_options

namespace {

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

struct Scratch {  // per calling thread; the x buffers are reused every call
  std::vector<int16_t> xa;  // int16, or int8 in its first half
  std::vector<float> dx, xsum;
};

void check(const torch::Tensor& q, const torch::Tensor& scale, const torch::Tensor& zero, int64_t bits, int64_t isa) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(isa_supported(isa), "instruction set ", isa, " is not supported by this CPU (0 scalar, 1 AVX2, 2 AVX-512 VNNI)");
  TORCH_CHECK(q.dtype() == torch::kUInt8 && q.is_contiguous() && q.dim() == 2, "q: contiguous uint8 [N, Kp*bits/8]");
  TORCH_CHECK(scale.dtype() == torch::kFloat32 && zero.dtype() == torch::kUInt8 && scale.is_contiguous() &&
              zero.is_contiguous() && scale.dim() == 2 && scale.size(0) == q.size(0) && zero.sizes() == scale.sizes(),
              "scale f32 / zero points uint8: contiguous [N, Kp/32]");
  TORCH_CHECK(scale.size(1) % 8 == 0 && q.size(1) * 8 == scale.size(1) * 32 * bits,
              "q and scale disagree on Kp (a multiple of 256): weights not made by pack()");
}

template <typename XT>
void run_gemv(int64_t isa, int64_t bits, int64_t M, const XT* xa, const float* dx, const float* xsum, int64_t S,
              const uint8_t* q, const float* scale, const uint8_t* zero, int64_t n0, int64_t n1, int64_t N, float* y) {
  if (isa == SCALAR) {
    gemv_scalar(bits, M, xa, dx, xsum, S, q, scale, zero, n0, n1, N, y);
  } else if constexpr (sizeof(XT) == 1) {
    if (isa == AVX512VNNI) avx512::gemv_any(bits, M, xa, dx, xsum, S, q, scale, zero, n0, n1, N, y);
    else avx2::gemv_any(bits, M, xa, dx, xsum, S, q, scale, zero, n0, n1, N, y);
  } else {
    avx2::gemv_any(bits, M, xa, dx, xsum, S, q, scale, zero, n0, n1, N, y);
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
  const int64_t Kp = (K + GROUP - 1) / GROUP * GROUP, S = Kp / 32, per = block / 32, row_bytes = Kp * bits / 8;
  auto qt = q.t().contiguous();  // [N, K]
  TORCH_CHECK(bits == 8 || qt.max().item<int64_t>() < 16, "4-bit weights hold values above 15");
  auto packed = torch::zeros({N, row_bytes}, q.options());
  const uint8_t* src = qt.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t g = k / GROUP, j = k % GROUP / 32, o = k % 32;
      const uint8_t v = src[n * K + k];
      if (bits == 8) dst[n * row_bytes + GROUP * g + 32 * (o / 4) + 4 * j + o % 4] = v;
      else dst[n * row_bytes + GROUP / 2 * g + 32 * (o / 8) + 4 * j + o % 4] |= o % 8 >= 4 ? v << 4 : v;
    }
  }
  auto s = torch::zeros({N, S}, scale.options());
  auto z = torch::zeros({N, S}, zero.options());
  s.narrow(1, 0, K / 32).copy_(scale.t().repeat_interleave(per, 1));
  z.narrow(1, 0, K / 32).copy_(zero.t().repeat_interleave(per, 1));
  return {packed, s, z};
}

// y = x W^T. act_bits 8 or 16: x's integer width. `threads`: the kernel's own OpenMP team. The
// runtime keeps torch's intra-op pool at one thread during decode (small ops lose more to fork/join
// than they gain) and gives the matmuls the cores.
torch::Tensor gemv(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor zero, int64_t bits,
                   int64_t threads, int64_t act_bits, int64_t isa) {
  check(q, scale, zero, bits, isa);
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "act_bits must be 8 or 16");
  TORCH_CHECK(act_bits == 8 || isa != AVX512VNNI, "the AVX-512 VNNI kernel takes int8 x (int16: the AVX2 kernel)");
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "x: contiguous f32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), S = scale.size(1);
  TORCH_CHECK(K % 32 == 0 && K <= S * 32 && S * 32 - K < GROUP, "x's K does not match the packed weights");
  thread_local Scratch scratch;
  scratch.xa.resize(M * S * 32);
  scratch.dx.resize(M * S);
  scratch.xsum.resize(M * S);
  const int16_t* perm = arrangement(isa, act_bits, bits);
  const float* xp = x.data_ptr<float>();
  float *dxp = scratch.dx.data(), *xsp = scratch.xsum.data();
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const uint8_t* zp = zero.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (act_bits == 8) {
    int8_t* xa = reinterpret_cast<int8_t*>(scratch.xa.data());
    quantize_x(xp, M, K, S, perm, xa, dxp, xsp, threads);
    split_rows(N, threads, [&](int64_t n0, int64_t n1) { run_gemv(isa, bits, M, xa, dxp, xsp, S, qp, sp, zp, n0, n1, N, yp); });
  } else {
    int16_t* xa = scratch.xa.data();
    quantize_x(xp, M, K, S, perm, xa, dxp, xsp, threads);
    split_rows(N, threads, [&](int64_t n0, int64_t n1) { run_gemv(isa, bits, M, xa, dxp, xsp, S, qp, sp, zp, n0, n1, N, yp); });
  }
  return y;
}

// W [N, K] f32 into `out` (a reusable buffer), for torch.matmul / F.linear on many rows.
torch::Tensor dequant(torch::Tensor q, torch::Tensor scale, torch::Tensor zero, int64_t K, int64_t bits,
                      torch::Tensor out, int64_t threads, int64_t isa) {
  check(q, scale, zero, bits, isa);
  const int64_t N = q.size(0), S = scale.size(1);
  TORCH_CHECK(K % 32 == 0 && K <= S * 32 && S * 32 - K < GROUP, "K does not match the packed weights");
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.is_contiguous() && out.numel() >= N * K, "out too small");
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const uint8_t* zp = zero.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  split_rows(N, threads, [&](int64_t n0, int64_t n1) {
    if (isa == SCALAR) dequant_scalar(bits, qp, sp, zp, S, K, n0, n1, op);
    else avx2::dequant_rows(bits, qp, sp, zp, S, K, n0, n1, op);
  });
  return out.narrow(0, 0, N * K).view({N, K});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa_supported", &isa_supported, "whether this CPU runs instruction set n (0 scalar, 1 AVX2, 2 AVX-512 VNNI)");
  m.def("pack", &pack, "[K, N] blocked low-bit weights to the kernels' layout");
  m.def("gemv", &gemv, "low-bit weight-only matmul (GEMV for a few rows of x, integer GEMM for many)");
  m.def("dequant", &dequant, "low-bit weights to f32 [N, K]");
}
