// The per-token math of the clipped surrogate (hadw_kernels/reference/surrogate.py), shared by the
// surrogate kernel (surrogate.cpp) and the gradients-in-forward linear kernel
// (linear_logprob.cpp): the policy term and its derivative, the KL estimators and theirs.
//
// Derivatives follow autograd's rules for the reference's ops, ties included:
// torch.clamp passes the gradient on the closed interval (NaN: none), torch.maximum /
// torch.minimum split it evenly between equal operands. Values propagate NaN: a NaN at a
// valid position must give a NaN loss, never a finite wrong one.
//
// Every function is branch-free (selects, no calls into libm for fp32) and always
// inlined, so that the token loops of surrogate.cpp vectorise; fp64 (the tests' exact
// comparisons) uses libm.
#pragma once

#include <cmath>
#include <cstdint>

#include "hadw_config.h"  // generated from hadw_kernels/config.py by setup.py
#include "tile_math.h"

namespace hadw {

static_assert(config::kKlCount == 4, "config.KL_ESTIMATORS changed: teach kl_term (csrc/token_math.h) the new one");
static_assert(config::kLogRatioClamp >= 0.5 && config::kK3LogRatioClamp >= 0.5,
              "clamped_exp_minus_one_minus_x picks its series on the unclamped value");

// clamp that keeps NaN (std::clamp's result for NaN is unspecified).
template <typename T>
HADW_ALWAYS_INLINE T clamp_keep_nan(T x, T low, T high) {
  return x < low ? low : (x > high ? high : x);
}

// (GCC if-converts `&&` and `||` of comparisons into masks; `&` and `|` on the bools
// themselves stop it vectorising the loop.)
template <typename T>
HADW_ALWAYS_INLINE bool in_closed(T x, T low, T high) {
  return x >= low && x <= high;  // false for NaN
}

// exp(c) - 1 - c of c = x clamped to [-limit, limit] (limit >= 1/2, NaN kept), without
// the cancellation of the literal formula near 0: for |c| < 1/2 the Taylor series to
// c^12 (truncation < 2e-13 relative), above it the literal formula (which then loses at
// most a few ulp). An on-policy log-ratio's k3 (~1e-7) keeps its digits, and
// expm1(c) = clamped_exp_minus_one_minus_x(x, limit) + c for tiny c too. The series is
// chosen on x, not on c (the same choice: the clamp is the identity there). Chosen on c,
// GCC's partial redundancy elimination specialised the choice on each branch of the
// clamp into a select of masks that it cannot vectorise for AVX2, and the token loops
// ran scalar.
template <typename T>
HADW_ALWAYS_INLINE T clamped_exp_minus_one_minus_x(T x, T limit) {
  const T c = clamp_keep_nan(x, -limit, limit);
  T series = T(1.0 / 479001600.0);
  series = series * c + T(1.0 / 39916800.0);
  series = series * c + T(1.0 / 3628800.0);
  series = series * c + T(1.0 / 362880.0);
  series = series * c + T(1.0 / 40320.0);
  series = series * c + T(1.0 / 5040.0);
  series = series * c + T(1.0 / 720.0);
  series = series * c + T(1.0 / 120.0);
  series = series * c + T(1.0 / 24.0);
  series = series * c + T(1.0 / 6.0);
  series = series * c + T(0.5);
  const T small = c * c * series;
  const T large = vector_exp(c) - T(1) - c;
  return (x > T(-0.5) && x < T(0.5)) ? small : large;  // NaN: large, NaN
}

// Clip range and dual clip, in the compute type (the reference rounds its Python-float
// thresholds to the tensors' dtype).
template <typename T>
struct ClipOptions {
  T ratio_low;   // 1 - epsilon_low
  T ratio_high;  // 1 + epsilon_high
  bool has_dual_clip;
  T dual_clip;
};

template <typename T>
struct Term {
  T value;
  T slope;  // d value / d (its argument)
};

// -min(rho A, clip(rho) A), bounded by -c A for A < 0 under dual clip, and its derivative
// with respect to rho. The unclipped branch passes -A when it is the larger, or when rho
// lies inside the clip range (both branches are then equal, the clamp passes its
// gradient on [low, high]); at the dual-clip bound torch.minimum splits the gradient.
template <typename T>
HADW_ALWAYS_INLINE Term<T> clipped_objective(T ratio, T advantage, const ClipOptions<T>& clip) {
  const T unclipped = -ratio * advantage;
  const T clipped = -clamp_keep_nan(ratio, clip.ratio_low, clip.ratio_high) * advantage;
  T value = (unclipped != unclipped || unclipped > clipped) ? unclipped : clipped;
  const bool passes = unclipped > clipped || in_closed(ratio, clip.ratio_low, clip.ratio_high);
  T slope = passes ? -advantage : T(0);
  const bool bounded = clip.has_dual_clip && advantage < 0;
  const T bound = -clip.dual_clip * advantage;
  const bool above = bounded && value > bound;  // NaN: false, and NaN stays NaN
  slope = above ? T(0) : ((bounded && value == bound) ? slope * T(0.5) : slope);
  value = above ? bound : value;
  return {value, slope};
}

template <typename T>
struct PolicyTerm {
  T value;  // the token's objective
  T slope;  // d value / d logp
  T ratio;  // rho, for the metrics
};

// The objective of a token whose log-ratio to the old policy is `log_ratio`:
// rho = exp(log-ratio clamped to +-LOG_RATIO_CLAMP); the clamp passes the gradient on
// the closed interval only. At sequence level the caller passes the response's mean
// log-ratio: every token then carries s_i and d s_it / d logp_t = s_i.
template <typename T>
HADW_ALWAYS_INLINE PolicyTerm<T> policy_term(T log_ratio, T advantage, const ClipOptions<T>& clip) {
  const T limit = static_cast<T>(config::kLogRatioClamp);
  const T ratio = vector_exp(clamp_keep_nan(log_ratio, -limit, limit));
  const Term<T> term = clipped_objective(ratio, advantage, clip);
  return {term.value, in_closed(log_ratio, -limit, limit) ? term.slope * ratio : T(0), ratio};
}

// expm1(x) - x of the clamped log-ratio: the approx_kl metric's k3 of KL(pi_old || pi).
template <typename T>
HADW_ALWAYS_INLINE T approx_kl_term(T log_ratio) {
  const T limit = static_cast<T>(config::kLogRatioClamp);
  return clamped_exp_minus_one_minus_x(log_ratio, limit);
}

// A KL(pi || pi_ref) estimate of one token and its derivative with respect to logp
// (config.KL_ESTIMATORS; k3 with verl's clamps, through exp(d) - 1 - d computed without
// cancellation, so that the tiny deltas of a policy near its reference keep their digits).
template <int64_t kEstimator, typename T>
HADW_ALWAYS_INLINE Term<T> kl_term(T logprob, T ref_logprob) {
  const T log_ratio = logprob - ref_logprob;
  if constexpr (kEstimator == config::kKlK1) {
    return {log_ratio, T(1)};
  } else if constexpr (kEstimator == config::kKlK2) {
    return {T(0.5) * log_ratio * log_ratio, log_ratio};
  } else if constexpr (kEstimator == config::kKlK3) {
    const T delta_limit = static_cast<T>(config::kK3LogRatioClamp);
    const T value_limit = static_cast<T>(config::kK3ValueClamp);
    const T ref_delta = -log_ratio;
    const T clamped = clamp_keep_nan(ref_delta, -delta_limit, delta_limit);
    const T raw = clamped_exp_minus_one_minus_x(ref_delta, delta_limit);
    const bool passes = in_closed(ref_delta, -delta_limit, delta_limit) && in_closed(raw, -value_limit, value_limit);
    // d/dlogp (exp(d) - 1 - d) with d = ref - logp: -(exp(d) - 1) = -(raw + d)
    return {clamp_keep_nan(raw, -value_limit, value_limit), passes ? -(raw + clamped) : T(0)};
  } else {
    static_assert(kEstimator == config::kKlAbs, "unknown KL estimator");
    const T sign = log_ratio > 0 ? T(1) : (log_ratio < 0 ? T(-1) : T(0));
    return {log_ratio < 0 ? -log_ratio : log_ratio, sign};
  }
}

// kl_term for an estimator code known only at run time (one token at a time).
template <typename T>
Term<T> kl_term(int64_t estimator, T logprob, T ref_logprob) {
  switch (estimator) {
    case config::kKlK1:
      return kl_term<config::kKlK1>(logprob, ref_logprob);
    case config::kKlK2:
      return kl_term<config::kKlK2>(logprob, ref_logprob);
    case config::kKlK3:
      return kl_term<config::kKlK3>(logprob, ref_logprob);
    default:
      return kl_term<config::kKlAbs>(logprob, ref_logprob);
  }
}

}  // namespace hadw
