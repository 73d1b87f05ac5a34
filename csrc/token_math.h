// The per-token math of the clipped surrogate (hadw_kernels/surrogate.py), shared by the
// surrogate kernel (surrogate.cpp) and the gradients-in-forward linear kernel
// (linear_logprob.cpp): the policy term and its derivative, the KL estimators and theirs.
//
// Derivatives follow autograd's rules for the reference's ops, ties included:
// torch.clamp passes the gradient on the closed interval (NaN: none), torch.maximum /
// torch.minimum split it evenly between equal operands. Values propagate NaN: a NaN at a
// valid position must give a NaN loss, never a finite wrong one.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "hadw_config.h"  // generated from hadw_kernels/config.py by setup.py

namespace hadw {

static_assert(config::kKlCount == 4, "config.KL_ESTIMATORS changed: teach kl_term (csrc/token_math.h) the new one");

// clamp that keeps NaN (std::clamp's result for NaN is unspecified).
template <typename T>
inline T clamp_keep_nan(T x, T low, T high) {
  return x < low ? low : (x > high ? high : x);
}

template <typename T>
inline bool in_closed(T x, T low, T high) {
  return x >= low && x <= high;  // false for NaN
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
inline Term<T> clipped_objective(T ratio, T advantage, const ClipOptions<T>& clip) {
  const T unclipped = -ratio * advantage;
  const T clipped = -clamp_keep_nan(ratio, clip.ratio_low, clip.ratio_high) * advantage;
  Term<T> term;
  term.value = (std::isnan(unclipped) || unclipped > clipped) ? unclipped : clipped;
  const bool passes = unclipped > clipped || in_closed(ratio, clip.ratio_low, clip.ratio_high);
  term.slope = passes ? -advantage : T(0);
  if (clip.has_dual_clip && advantage < 0) {
    const T bound = -clip.dual_clip * advantage;
    if (term.value > bound) {
      term = {bound, T(0)};
    } else if (term.value == bound) {
      term.slope *= T(0.5);
    }
  }
  return term;
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
inline PolicyTerm<T> policy_term(T log_ratio, T advantage, const ClipOptions<T>& clip) {
  const T limit = static_cast<T>(config::kLogRatioClamp);
  const T ratio = std::exp(clamp_keep_nan(log_ratio, -limit, limit));
  const Term<T> term = clipped_objective(ratio, advantage, clip);
  return {term.value, in_closed(log_ratio, -limit, limit) ? term.slope * ratio : T(0), ratio};
}

// expm1(x) - x of the clamped log-ratio: the approx_kl metric's k3 of KL(pi_old || pi).
template <typename T>
inline T approx_kl_term(T log_ratio) {
  const T limit = static_cast<T>(config::kLogRatioClamp);
  const T clamped = clamp_keep_nan(log_ratio, -limit, limit);
  return std::expm1(clamped) - clamped;
}

// A KL(pi || pi_ref) estimate of one token and its derivative with respect to logp
// (config.KL_ESTIMATORS; k3 with verl's clamps, through expm1 so that the tiny deltas of
// a policy near its reference keep their digits).
template <typename T>
inline Term<T> kl_term(T logprob, T ref_logprob, int64_t estimator) {
  const T log_ratio = logprob - ref_logprob;
  switch (estimator) {
    case config::kKlK1:
      return {log_ratio, T(1)};
    case config::kKlK2:
      return {T(0.5) * log_ratio * log_ratio, log_ratio};
    case config::kKlK3: {
      const T delta_limit = static_cast<T>(config::kK3LogRatioClamp);
      const T value_limit = static_cast<T>(config::kK3ValueClamp);
      const T ref_delta = -log_ratio;
      const T clamped = clamp_keep_nan(ref_delta, -delta_limit, delta_limit);
      const T exp_minus_one = std::expm1(clamped);
      const T raw = exp_minus_one - clamped;
      const bool passes = in_closed(ref_delta, -delta_limit, delta_limit) && in_closed(raw, -value_limit, value_limit);
      return {clamp_keep_nan(raw, -value_limit, value_limit), passes ? -exp_minus_one : T(0)};
    }
    default: {  // abs
      const T sign = static_cast<T>((log_ratio > 0) - (log_ratio < 0));
      return {std::abs(log_ratio), sign};
    }
  }
}

}  // namespace hadw
