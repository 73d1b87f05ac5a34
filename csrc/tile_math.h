// Row math of one vocabulary tile of logits: the online log-sum-exp (forward) and the
// logits gradient (backward), applied while the tile the GEMM just wrote is in cache.
//
// The loops are plain C++ that GCC vectorises (`omp simd` lets it reorder the row
// reductions). Every function here is always_inline so that it is compiled into each
// target clone of its caller (see HADW_VECTOR_CLONES) with that clone's instruction set.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && defined(__x86_64__) && defined(__ELF__)
// One binary for every x86-64 CPU: GCC compiles the caller for AVX-512, AVX2 and the
// baseline, and the loader picks the best one the CPU has (ifunc). This is why setup.py
// passes no -march flag: a wheel built here also runs on a CPU without AVX-512.
#define HADW_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
// The softmax row loops also have hand-written AVX-512 and AVX2 kernels, taken when the
// CPU has them.
#define HADW_X86_ROWS 1
#include <immintrin.h>
#else
#define HADW_VECTOR_CLONES
#define HADW_X86_ROWS 0
#endif

#define HADW_ALWAYS_INLINE inline __attribute__((always_inline))
// The same for a lambda, whose call operator is inline already.
#define HADW_ALWAYS_INLINE_LAMBDA __attribute__((always_inline))

namespace hadw {

// The constants of the fp32 exp, for vector_exp and exp_avx512 (the same steps).
namespace exp_f32 {
constexpr float kLowest = -87.33654f;  // log(FLT_MIN): exp is 0 below it
constexpr float kHighest = 88.72283f;  // log(FLT_MAX)
constexpr float kLog2e = 1.44269504088896341f;
// ln 2 split in a part exact in fp32 and a remainder, so r = x - k ln 2 loses nothing.
constexpr float kLn2High = 0.693145751953125f;
constexpr float kLn2Low = 1.428606765330187045e-06f;
// Taylor coefficients of exp(r), highest degree first: 1/7!, 1/6!, ..., 1/1!, 1/0!.
constexpr float kPolynomial[] = {1.0f / 5040.0f, 1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f,
                                 1.0f / 6.0f,    0.5f,           1.0f,           1.0f};
constexpr int kDegree = sizeof(kPolynomial) / sizeof(kPolynomial[0]) - 1;
}  // namespace exp_f32

// exp for fp32 that the compiler can vectorise (std::exp is a libm call per element):
// exp(x) = 2^k * exp(r) with k = round(x / ln 2), |r| <= ln(2)/2, and a degree-7 Taylor
// polynomial for exp(r) (truncation error < 5e-9 relative, below fp32 rounding; its
// error against double exp: docs/architecture.md, "C++: the surrogate kernel"). Underflows to 0
// below the smallest normal result, like std::exp up to denormals.
HADW_ALWAYS_INLINE float vector_exp(float x) {
  using namespace exp_f32;
  constexpr float kRoundingShift = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float clamped = std::min(std::max(x, kLowest), kHighest);
  const float k = (clamped * kLog2e + kRoundingShift) - kRoundingShift;
  float r = clamped - k * kLn2High;
  r = r - k * kLn2Low;
  float p = kPolynomial[0];
  for (int degree = 1; degree <= kDegree; ++degree) {
    p = p * r + kPolynomial[degree];
  }
  const int32_t exponent_bits = (static_cast<int32_t>(k) + 127) << 23;
  float power_of_two;
  std::memcpy(&power_of_two, &exponent_bits, sizeof(float));
  return x < kLowest ? 0.0f : p * power_of_two;
}

// fp64 runs the tests' exact comparisons, not hot loops: libm's exp is the right one.
HADW_ALWAYS_INLINE double vector_exp(double x) { return std::exp(x); }

// Running softmax statistics of one row over the vocabulary columns seen so far:
//   max      the largest logit
//   sum      sum of exp(z - max)
//   shifted  sum of exp(z - max) * (z - max)
// Keeping `shifted` relative to the max gives the entropy as log(sum) - shifted/sum,
// without the cancellation of lse - E[z] when logits are large.
template <typename T>
struct SoftmaxState {
  T max = -std::numeric_limits<T>::infinity();
  T sum = 0;
  T shifted = 0;

  // Folds in the statistics of other columns (same meaning, relative to part.max).
  void merge(const SoftmaxState& part) {
    if (part.sum == 0) {
      return;
    }
    if (sum == 0) {
      *this = part;
      return;
    }
    const T new_max = std::max(max, part.max);
    const T own_offset = max - new_max;
    const T part_offset = part.max - new_max;
    const T own_scale = std::exp(own_offset);
    const T part_scale = std::exp(part_offset);
    shifted = (shifted + own_offset * sum) * own_scale + (part.shifted + part_offset * part.sum) * part_scale;
    sum = sum * own_scale + part.sum * part_scale;
    max = new_max;
  }

  T lse() const { return max + std::log(sum); }
  T mean_logit() const { return max + shifted / sum; }
  T entropy() const { return std::log(sum) - shifted / sum; }
};

// An offset z - shift, or 0 where it is -inf (a -inf logit: vocabulary masking), whose
// weight exp(-inf) is 0: the entropy's p log p and p (z - E[z]) are then 0, not
// 0 * -inf = NaN (docs/math.md, section 8, "Entropy"). A NaN stays NaN.
template <typename T>
HADW_ALWAYS_INLINE T finite_offset(T offset) {
  return offset == -std::numeric_limits<T>::infinity() ? T(0) : offset;
}

// The sums of one row of logits z relative to `shift` (at least the row's largest):
//   sum = sum exp(z - shift),  shifted = sum exp(z - shift) (z - shift),
// and with keep_numerators, z[col] replaced by exp(z[col] - shift).
template <typename T>
HADW_ALWAYS_INLINE void portable_row_sums(T* z, int64_t cols, T shift, bool keep_numerators, T* sum_out,
                                          T* shifted_out) {
  T sum = 0;
  T shifted = 0;
  // Two loops, not one with the store under `if (keep_numerators)`: GCC 12 unswitches
  // that one, but vectorises the copy without the store badly (docs/architecture.md, "C++: building").
  if (keep_numerators) {
#pragma omp simd reduction(+ : sum, shifted)
    for (int64_t col = 0; col < cols; ++col) {
      const T offset = z[col] - shift;
      const T weight = vector_exp(offset);
      sum += weight;
      shifted += weight * finite_offset(offset);
      z[col] = weight;
    }
  } else {
#pragma omp simd reduction(+ : sum, shifted)
    for (int64_t col = 0; col < cols; ++col) {
      const T offset = z[col] - shift;
      const T weight = vector_exp(offset);
      sum += weight;
      shifted += weight * finite_offset(offset);
    }
  }
  *sum_out = sum;
  *shifted_out = shifted;
}

#if HADW_X86_ROWS
// GCC 12's avx512fintrin.h seeds some intrinsics with _mm512_undefined_ps and then warns
// about its own placeholder when they are inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// vector_exp's steps in 16 lanes, for x <= 0 (or NaN): k = round(x / ln 2) with one
// rounding instruction, the same split of ln 2 and polynomial, and vscalefps for
// p * 2^k. What GCC makes of vector_exp needs about twice the instructions (its range
// clamps and the underflow select become masks on every step), and the row loop is
// bound by them. 0 below log(FLT_MIN), like vector_exp; NaN stays NaN.
__attribute__((target("avx512f"), always_inline)) inline __m512 exp_avx512(__m512 x) {
  using namespace exp_f32;
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kPolynomial[0]);
  for (int degree = 1; degree <= kDegree; ++degree) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kPolynomial[degree]));
  }
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kLowest), _CMP_LT_OQ);
  return _mm512_mask_mov_ps(_mm512_scalef_ps(p, k), underflow, _mm512_setzero_ps());
}

// portable_row_sums for fp32 in AVX-512, prefetching `next` (a row of the same length, or
// null) one cache line per 16 columns: the fold's two passes over a row (its max, then
// this) otherwise wait on memory for every row the GEMM left in L3.
__attribute__((target("avx512f"))) inline void avx512_row_sums(float* z, int64_t cols, float shift,
                                                               bool keep_numerators, const float* next,
                                                               float* sum_out, float* shifted_out) {
  const __m512 shifts = _mm512_set1_ps(shift);
  const __m512 minus_infinity = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 sum = _mm512_setzero_ps();
  __m512 shifted = _mm512_setzero_ps();
  for (int64_t col = 0; col < cols; col += 16) {
    const __mmask16 lanes = cols - col >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (cols - col)) - 1);
    if (next != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(next + col), _MM_HINT_T0);
    }
    const __m512 offset = _mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, z + col), shifts);
    const __m512 weight = _mm512_maskz_mov_ps(lanes, exp_avx512(offset));
    sum = _mm512_add_ps(sum, weight);
    // finite_offset: a -inf offset adds nothing (NEQ_UQ keeps NaN lanes).
    const __mmask16 finite = _mm512_mask_cmp_ps_mask(lanes, offset, minus_infinity, _CMP_NEQ_UQ);
    shifted = _mm512_mask3_fmadd_ps(weight, offset, shifted, finite);
    if (keep_numerators) {
      _mm512_mask_storeu_ps(z + col, lanes, weight);
    }
  }
  *sum_out = _mm512_reduce_add_ps(sum);
  *shifted_out = _mm512_reduce_add_ps(shifted);
}

#pragma GCC diagnostic pop

// exp_avx512's steps in 8 lanes, for x <= 0 (or NaN), with AVX2 and FMA. As with
// AVX-512, what GCC makes of the portable loops costs time on an AVX2 machine too
// (docs/architecture.md, "C++: building"). 2^k is built in the exponent bits: x >= log(FLT_MIN)
// gives k >= -126, a normal power of two; below, the result is masked to 0.
__attribute__((target("avx2,fma"), always_inline)) inline __m256 exp_avx2(__m256 x) {
  using namespace exp_f32;
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kPolynomial[0]);
  for (int degree = 1; degree <= kDegree; ++degree) {
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kPolynomial[degree]));
  }
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(kLowest), _CMP_LT_OQ);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(exponent)));
}

// The first `count` (at most 8) lanes set, for the masked loads and stores of a row's tail.
__attribute__((target("avx2"), always_inline)) inline __m256i avx2_tail_lanes(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The sum of a vector's lanes.
__attribute__((target("avx2"), always_inline)) inline float avx2_lane_sum(__m256 v) {
  const __m128 halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}

// avx512_row_sums in AVX2: two 8-lane accumulators per sum (the adds' latency), the same
// prefetch of the next row.
__attribute__((target("avx2,fma"))) inline void avx2_row_sums(float* z, int64_t cols, float shift,
                                                              bool keep_numerators, const float* next,
                                                              float* sum_out, float* shifted_out) {
  const __m256 shifts = _mm256_set1_ps(shift);
  const __m256 minus_infinity = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 shifted[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t col = 0;
  for (; col + 16 <= cols; col += 16) {
    if (next != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(next + col), _MM_HINT_T0);
    }
    for (int part = 0; part < 2; ++part) {
      const __m256 offset = _mm256_sub_ps(_mm256_loadu_ps(z + col + 8 * part), shifts);
      const __m256 weight = exp_avx2(offset);
      sum[part] = _mm256_add_ps(sum[part], weight);
      // finite_offset: a -inf offset counts as 0 (NEQ_UQ keeps NaN lanes).
      const __m256 finite = _mm256_and_ps(offset, _mm256_cmp_ps(offset, minus_infinity, _CMP_NEQ_UQ));
      shifted[part] = _mm256_fmadd_ps(weight, finite, shifted[part]);
      if (keep_numerators) {
        _mm256_storeu_ps(z + col + 8 * part, weight);
      }
    }
  }
  for (; col < cols; col += 8) {
    const __m256i lanes = avx2_tail_lanes(std::min<int64_t>(cols - col, 8));
    const __m256 offset = _mm256_and_ps(_mm256_sub_ps(_mm256_maskload_ps(z + col, lanes), shifts),
                                        _mm256_castsi256_ps(lanes));
    const __m256 weight = _mm256_and_ps(exp_avx2(offset), _mm256_castsi256_ps(lanes));
    sum[0] = _mm256_add_ps(sum[0], weight);
    const __m256 finite = _mm256_and_ps(offset, _mm256_cmp_ps(offset, minus_infinity, _CMP_NEQ_UQ));
    shifted[0] = _mm256_fmadd_ps(weight, finite, shifted[0]);
    if (keep_numerators) {
      _mm256_maskstore_ps(z + col, lanes, weight);
    }
  }
  *sum_out = avx2_lane_sum(_mm256_add_ps(sum[0], sum[1]));
  *shifted_out = avx2_lane_sum(_mm256_add_ps(shifted[0], shifted[1]));
}

// row_max for fp32 in AVX2, four 8-lane accumulators. max_ps(v, m) is v > m ? v : m, so
// a NaN logit is skipped like in row_max.
__attribute__((target("avx2"))) inline float avx2_row_max(const float* z, int64_t n) {
  const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 lanes[4] = {lowest, lowest, lowest, lowest};
  int64_t col = 0;
  for (; col + 32 <= n; col += 32) {
    for (int part = 0; part < 4; ++part) {
      lanes[part] = _mm256_max_ps(_mm256_loadu_ps(z + col + 8 * part), lanes[part]);
    }
  }
  alignas(32) float values[8];
  _mm256_store_ps(values, _mm256_max_ps(_mm256_max_ps(lanes[0], lanes[1]), _mm256_max_ps(lanes[2], lanes[3])));
  float result = values[0];
  for (int lane = 1; lane < 8; ++lane) {
    result = std::max(result, values[lane]);
  }
  for (; col < n; ++col) {
    result = z[col] > result ? z[col] : result;
  }
  return result;
}
#endif

// Which row kernels run: the widest the CPU has (AVX-512F, then AVX2 with FMA, then the
// portable loops), capped by HADW_CPP_ROW_KERNELS ("avx2" or "portable": to compare
// them, or to test the narrower ones on a wider CPU). Read once.
enum class RowKernels { kPortable, kAvx2, kAvx512 };

inline RowKernels selected_row_kernels() {
#if HADW_X86_ROWS
  static const RowKernels selected = [] {
    RowKernels widest = RowKernels::kPortable;
    if (__builtin_cpu_supports("avx512f")) {
      widest = RowKernels::kAvx512;
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      widest = RowKernels::kAvx2;
    }
    const char* cap = std::getenv("HADW_CPP_ROW_KERNELS");
    if (cap != nullptr && std::strcmp(cap, "portable") == 0) {
      return RowKernels::kPortable;
    }
    if (cap != nullptr && std::strcmp(cap, "avx2") == 0) {
      return std::min(widest, RowKernels::kAvx2);
    }
    return widest;
  }();
  return selected;
#else
  return RowKernels::kPortable;
#endif
}

inline const char* row_kernels_name(RowKernels kernels) {
  switch (kernels) {
    case RowKernels::kAvx512:
      return "avx512";
    case RowKernels::kAvx2:
      return "avx2";
    default:
      return "portable";
  }
}

// Largest of z[0, n), with GCC vector types: GCC vectorises neither a floating-point
// max reduction (even under `omp simd`) nor its unrolled lanes without -ffast-math,
// which the inf/NaN handling here cannot have. A 64-byte vector is one AVX-512
// register, two AVX2 or four SSE ones, whichever the clone has.
template <typename T>
HADW_ALWAYS_INLINE T row_max(const T* z, int64_t n) {
  typedef T Lanes __attribute__((vector_size(64)));
  constexpr int64_t kLanes = 64 / sizeof(T);
  Lanes lanes;
  for (int64_t lane = 0; lane < kLanes; ++lane) {
    lanes[lane] = -std::numeric_limits<T>::infinity();
  }
  int64_t col = 0;
  for (; col + kLanes <= n; col += kLanes) {
    Lanes values;
    std::memcpy(&values, z + col, sizeof(Lanes));
    lanes = values > lanes ? values : lanes;
  }
  T result = -std::numeric_limits<T>::infinity();
  for (; col < n; ++col) {
    result = std::max(result, z[col]);
  }
  for (int64_t lane = 0; lane < kLanes; ++lane) {
    result = std::max(result, lanes[lane]);
  }
  return result;
}

// The row kernels' dispatch (selected_row_kernels); fp64 always takes the portable loops.
template <typename T>
HADW_ALWAYS_INLINE void softmax_row_sums(T* z, int64_t cols, T shift, bool keep_numerators, const T* next,
                                         T* sum_out, T* shifted_out) {
#if HADW_X86_ROWS
  if constexpr (std::is_same_v<T, float>) {
    switch (selected_row_kernels()) {
      case RowKernels::kAvx512:
        avx512_row_sums(z, cols, shift, keep_numerators, next, sum_out, shifted_out);
        return;
      case RowKernels::kAvx2:
        avx2_row_sums(z, cols, shift, keep_numerators, next, sum_out, shifted_out);
        return;
      default:
        break;
    }
  }
#endif
  (void)next;
  portable_row_sums(z, cols, shift, keep_numerators, sum_out, shifted_out);
}

// The AVX-512 clone of row_max is one register wide already; the AVX2 one spills.
template <typename T>
HADW_ALWAYS_INLINE T softmax_row_max(const T* z, int64_t n) {
#if HADW_X86_ROWS
  if constexpr (std::is_same_v<T, float>) {
    if (selected_row_kernels() == RowKernels::kAvx2) {
      return avx2_row_max(z, n);
    }
  }
#endif
  return row_max(z, n);
}

// z = raw * scale + scaled_bias, in place (the identity when scale is 1 without bias).
template <typename T>
HADW_ALWAYS_INLINE void to_logits(T* z, int64_t n, T scale, const T* scaled_bias) {
  if (scaled_bias != nullptr) {
    for (int64_t col = 0; col < n; ++col) {
      z[col] = z[col] * scale + scaled_bias[col];
    }
  } else if (scale != T(1)) {
    for (int64_t col = 0; col < n; ++col) {
      z[col] = z[col] * scale;
    }
  }
}

// Forward, one tile [rows, cols] of raw products h W^T (row-major, contiguous):
// turns them into logits z = raw * scale + scaled_bias in place, folds each row into
// its state, and picks the label's logit for rows whose label lies in this tile.
// With `shifts`, the tile is left holding exp(z - shifts[row]) instead of z (the
// numerators of the softmax, relative to the row's running max): the gradient pass then
// needs one multiply per logit, not an exp (scaled_probability_rows).
template <typename T>
HADW_ALWAYS_INLINE void fold_tile(T* tile, int64_t rows, int64_t cols, T scale, const T* scaled_bias,
                                  SoftmaxState<T>* states, const int64_t* labels, int64_t first_column,
                                  T* label_logits, T* shifts) {
  for (int64_t row = 0; row < rows; ++row) {
    T* z = tile + row * cols;
    to_logits(z, cols, scale, scaled_bias);
    const int64_t label_column = labels[row] - first_column;
    if (label_column >= 0 && label_column < cols) {
      label_logits[row] = z[label_column];
    }
    SoftmaxState<T> part;
    part.max = std::max(states[row].max, softmax_row_max(z, cols));
    if (part.max == -std::numeric_limits<T>::infinity()) {
      // Every logit so far is -inf: nothing to add (and no -inf - -inf).
      if (shifts != nullptr) {
        shifts[row] = 0;
        std::fill(z, z + cols, T(0));
      }
      continue;
    }
    if (shifts != nullptr) {
      shifts[row] = part.max;
    }
    // The next row's max pass then reads it from cache, not from L3.
    const T* next_row = row + 1 < rows ? z + cols : nullptr;
    softmax_row_sums(z, cols, part.max, shifts != nullptr, next_row, &part.sum, &part.shifted);
    states[row].merge(part);
  }
}

// The logits gradient of a tile that fold_tile left holding exp(z - shift): row k of
// `out` (ld out_ld) gets, from row source[k] of `numerators` (ld in_ld),
//   g (onehot(y) - p) scale,  p = numerator * exp(shift - lse) = numerator * factor / (-g scale)
// given factor[k] = -g exp(shift - lse) scale and onehot[k] = g scale. No entropy term:
// it needs the logits themselves (logit_gradient_rows). `out` may alias `numerators`
// with source[k] >= k (rows move up): each row is read before it is overwritten.
template <typename T>
HADW_ALWAYS_INLINE void scaled_probability_rows(const T* numerators, int64_t in_ld, const int64_t* source, T* out,
                                                int64_t out_ld, int64_t rows, int64_t cols, const T* factor,
                                                const T* onehot, const int64_t* labels, int64_t first_column,
                                                T* bias_gradient) {
  for (int64_t row = 0; row < rows; ++row) {
    const T* numerator = numerators + (source == nullptr ? row : source[row]) * in_ld;
    T* grad = out + row * out_ld;
    const T row_factor = factor[row];
#pragma omp simd
    for (int64_t col = 0; col < cols; ++col) {
      grad[col] = numerator[col] * row_factor;
    }
    const int64_t label_column = labels[row] - first_column;
    if (label_column >= 0 && label_column < cols) {
      grad[label_column] += onehot[row];
    }
    if (bias_gradient != nullptr) {
#pragma omp simd
      for (int64_t col = 0; col < cols; ++col) {
        bias_gradient[col] += grad[col];
      }
    }
  }
}

// The logits gradient of `rows` rows of one vocabulary tile: row k of `out` (ld
// out_ld) gets, from row source[k] of the logits tile `z` (ld z_ld; source null: row k),
//   d/dz (g logp(y) + e H) = g (onehot(y) - p) - e p (z - E[z]),  p = exp(z - lse)
// times `scale` (1/temperature: the derivative of z by the raw product h.w). The per-row
// values (g, e, lse, E[z], label) are indexed by k. A label outside this tile (or the
// vocabulary) gets no one-hot term. Adds each column's sum to bias_gradient when given.
// `out` may be `z` itself (source null, same ld): each element is read before written.
template <typename T>
HADW_ALWAYS_INLINE void logit_gradient_rows(const T* z, int64_t z_ld, const int64_t* source, T* out, int64_t out_ld,
                                            int64_t rows, int64_t cols, T scale, const T* lse, const T* mean_logit,
                                            const T* grad_logprobs, const T* grad_entropy, const int64_t* labels,
                                            int64_t first_column, T* bias_gradient) {
  for (int64_t row = 0; row < rows; ++row) {
    const T* logits = z + (source == nullptr ? row : source[row]) * z_ld;
    T* grad = out + row * out_ld;
    const T g = grad_logprobs[row];
    const T e = grad_entropy == nullptr ? T(0) : grad_entropy[row];
    const T row_lse = lse[row];
    if (e == 0) {
      const T factor = -g * scale;
#pragma omp simd
      for (int64_t col = 0; col < cols; ++col) {
        grad[col] = vector_exp(logits[col] - row_lse) * factor;
      }
    } else {
      const T row_mean = mean_logit[row];
#pragma omp simd
      for (int64_t col = 0; col < cols; ++col) {
        const T logit = logits[col];
        // At a -inf logit p = 0 and the entropy term p (z - E[z]) is 0 (finite_offset).
        const T centred = logit == -std::numeric_limits<T>::infinity() ? T(0) : logit - row_mean;
        grad[col] = -vector_exp(logit - row_lse) * (g + e * centred) * scale;
      }
    }
    const int64_t label_column = labels[row] - first_column;
    if (label_column >= 0 && label_column < cols) {
      grad[label_column] += g * scale;
    }
    if (bias_gradient != nullptr) {
#pragma omp simd
      for (int64_t col = 0; col < cols; ++col) {
        bias_gradient[col] += grad[col];
      }
    }
  }
}

}  // namespace hadw
