// The per-token math of the surrogate (hadw_kernels/reference/surrogate.py), shared by the
// surrogate kernel (surrogate.cpp) and the gradients-in-forward linear kernel
// (linear_logprob.cpp): each objective (hadw_kernels/objectives/formulas.py) and its derivatives, its
// formula of its response step (the row's response formula), the KL estimators and theirs.
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

#include <c10/util/Exception.h>

#include <cmath>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include "hadw_config.h"  // generated from hadw_kernels/config/loss_config.py by setup.py
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

// The clip range and the objective's option vector (config.OBJECTIVES,
// LossConfig.objective_options) in the compute type (the reference rounds its Python-float
// thresholds to the tensors' dtype), read by the generated kOption<Name> indices; an
// option that is off arrives as +inf. `exact` keeps the vector in double for the
// per-response steps that compute in double (a log_ratio_sum step's weight).
template <typename T>
struct ObjectiveOptions {
  T ratio_low;       // 1 - epsilon_low
  T ratio_high;      // 1 + epsilon_high
  T log_ratio_low;   // -epsilon_low: a clipped_log_ratio_mean step clips in log space
  T log_ratio_high;  // epsilon_high
  T values[config::kObjectiveOptionSlots] = {};
  double exact[config::kObjectiveOptionSlots] = {};

  HADW_ALWAYS_INLINE T operator[](int64_t index) const { return values[index]; }

  static ObjectiveOptions from(double epsilon_low, double epsilon_high, c10::ArrayRef<double> vector) {
    ObjectiveOptions options{static_cast<T>(1.0 - epsilon_low), static_cast<T>(1.0 + epsilon_high),
                             static_cast<T>(-epsilon_low), static_cast<T>(epsilon_high)};
    for (size_t index = 0; index < vector.size(); ++index) {
      options.values[index] = static_cast<T>(vector[index]);
      options.exact[index] = vector[index];
    }
    return options;
  }
};

// The vector's length is the objective's (config.OBJECTIVES): the kernels index it blindly.
inline void check_objective_options(const char* op, int64_t objective, c10::ArrayRef<double> vector) {
  TORCH_CHECK(static_cast<int64_t>(vector.size()) == config::kObjectiveOptionCounts[objective], op,
              ": objective ", objective, " takes ", config::kObjectiveOptionCounts[objective],
              " options (config.OBJECTIVES), got ", vector.size());
}

// The weight of the token's response by its response step log_ratio_sum (VESPO's phi), for
// a non-negative and for a negative advantage; no other objective reads it.
template <typename T>
struct ResponseWeights {
  T nonnegative = 0;
  T negative = 0;
};

template <typename T>
struct ObjectiveTerm {
  T value;      // l_t
  T d_ratio;    // d l_t / d rho
  T d_logprob;  // d l_t / d logp_t through the log-prob the objective holds itself
};

// PPO's clip of a token, max(-rho' A, -clip(rho) A), rho' = min(rho, delta), then
// min(., -c A) for A < 0 (c = dual_clip), each bound off at +inf; and d / d rho.
// torch.maximum passes the gradient to the larger operand, half to each at a tie; each
// operand's own clamp passes it on its closed interval; torch.minimum splits it at the
// dual-clip bound.
template <typename T>
HADW_ALWAYS_INLINE ObjectiveTerm<T> clip_term(T ratio, T advantage, const ObjectiveOptions<T>& options, T delta,
                                              T dual_clip) {
  const bool has_delta = delta != std::numeric_limits<T>::infinity();
  const T capped = ratio > delta ? delta : ratio;  // NaN kept
  const T unclipped = -capped * advantage;
  const T clipped = -clamp_keep_nan(ratio, options.ratio_low, options.ratio_high) * advantage;
  T value = (unclipped != unclipped || unclipped > clipped) ? unclipped : clipped;
  const T through_unclipped = (!has_delta || ratio <= delta) ? -advantage : T(0);
  const T through_clipped = in_closed(ratio, options.ratio_low, options.ratio_high) ? -advantage : T(0);
  T d_ratio = unclipped > clipped   ? through_unclipped
              : clipped > unclipped ? through_clipped
                                    : T(0.5) * (through_unclipped + through_clipped);
  const bool bounded = dual_clip != std::numeric_limits<T>::infinity() && advantage < 0;
  const T bound = -dual_clip * advantage;
  const bool above = bounded && value > bound;  // NaN: false, and NaN stays NaN
  d_ratio = above ? T(0) : ((bounded && value == bound) ? d_ratio * T(0.5) : d_ratio);
  value = above ? bound : value;
  return {value, d_ratio, T(0)};
}

// Whether a token's probability moved within DPPO's range in the direction its advantage
// favours (objectives.dppo_moved_within): by p - p_old (kTotalVariation) or by the
// binary KL of (p_old, p), the log's +1e-8 as verl's.
template <bool kTotalVariation, typename T>
HADW_ALWAYS_INLINE bool dppo_moved_within(T logprob, T old_logprob, T advantage, const ObjectiveOptions<T>& options) {
  const T prob = vector_exp(logprob);
  const T old_prob = vector_exp(old_logprob);
  if constexpr (kTotalVariation) {
    return advantage > 0 ? prob - old_prob <= options.log_ratio_high : prob - old_prob >= options.log_ratio_low;
  } else {
    const T binary_kl = old_prob * (old_logprob - logprob) +
                        (T(1) - old_prob) * std::log((T(1) - old_prob + T(1e-8)) / (T(1) - prob + T(1e-8)));
    return advantage > 0 ? (binary_kl <= options.log_ratio_high || prob <= old_prob)
                         : (binary_kl <= -options.log_ratio_low || prob >= old_prob);
  }
}

// The objective l_t of a token with ratio rho (in its ratio form), advantage A, log-prob l
// and behaviour log-prob l_old, and its two partial derivatives: objectives.py's VALUES and
// SLOPES, one branch each. `selected` is the token's selection by the objective's batch
// statistic (objectives.SELECTIONS; 0 or 1). A stop-gradient factor (CISPO's clipped ratio,
// VESPO's phi, DPPO's mask) enters d_logprob only.
template <int64_t kObjective, typename T>
HADW_ALWAYS_INLINE ObjectiveTerm<T> objective_term(T ratio, T advantage, T logprob, T old_logprob, T selected,
                                                   const ResponseWeights<T>& weights,
                                                   const ObjectiveOptions<T>& options) {
  static_assert(config::kObjectiveCount == 12,
                "config.OBJECTIVES changed: teach objective_term (csrc/token_math.h) the new one");
  if constexpr (kObjective == config::kObjectiveClip) {
    return clip_term(ratio, advantage, options, options[config::kOptionDelta], options[config::kOptionDualClip]);
  } else if constexpr (kObjective == config::kObjectiveCispoCap) {
    const T cap = options[config::kOptionRatioCap];
    const T weight = ratio > cap ? cap : ratio;  // NaN kept
    const T d_logprob = -weight * advantage;
    return {d_logprob * logprob, T(0), d_logprob};
  } else if constexpr (kObjective == config::kObjectiveCispoClip) {
    const T d_logprob = -clamp_keep_nan(ratio, options.ratio_low, options.ratio_high) * advantage;
    return {d_logprob * logprob, T(0), d_logprob};
  } else if constexpr (kObjective == config::kObjectiveSapo) {
    // -(4 / tau) sigmoid(tau (rho - 1)) A; d / d rho = -4 sigmoid (1 - sigmoid) A.
    const T temperature =
        advantage > 0 ? options[config::kOptionSapoTemperaturePos] : options[config::kOptionSapoTemperatureNeg];
    const T sigmoid = T(1) / (T(1) + vector_exp(-temperature * (ratio - T(1))));
    return {-(T(4) / temperature) * sigmoid * advantage, T(-4) * sigmoid * (T(1) - sigmoid) * advantage, T(0)};
  } else if constexpr (kObjective == config::kObjectiveGmpo) {
    // rho is the response's geometric mean of clipped ratios (response_log_ratio below).
    return {-advantage * ratio, -advantage, T(0)};
  } else if constexpr (kObjective == config::kObjectiveVespo) {
    const T d_logprob = -(advantage >= 0 ? weights.nonnegative : weights.negative) * advantage;
    return {d_logprob * logprob, T(0), d_logprob};
  } else if constexpr (kObjective == config::kObjectiveGpg) {
    return {-advantage * logprob, T(0), -advantage};
  } else if constexpr (kObjective == config::kObjectiveDppoTv || kObjective == config::kObjectiveDppoKl) {
    const T cap = options[config::kOptionRatioCap];
    const T weight = ratio > cap ? cap : ratio;  // NaN kept
    const bool moved = dppo_moved_within<kObjective == config::kObjectiveDppoTv>(logprob, old_logprob, advantage,
                                                                                  options);
    // Times the mask, not selected by it: a NaN (a NaN input) stays NaN, as the reference's.
    const T d_logprob = -weight * advantage * (moved ? T(1) : T(0));
    return {d_logprob * logprob, T(0), d_logprob};
  } else if constexpr (kObjective == config::kObjectiveDro) {
    // -(A l - beta / 2 (l - l_old)^2); d / d l = -A + beta (l - l_old).
    const T beta = options[config::kOptionDroBeta];
    const T log_ratio = logprob - old_logprob;
    return {-(logprob * advantage - T(0.5) * beta * (log_ratio * log_ratio)), T(0), -advantage + beta * log_ratio};
  } else if constexpr (kObjective == config::kObjectiveClipCov) {
    constexpr T kOff = std::numeric_limits<T>::infinity();  // no delta, no dual clip
    ObjectiveTerm<T> term = clip_term(ratio, advantage, options, kOff, kOff);
    const T kept = T(1) - selected;
    return {term.value * kept, term.d_ratio * kept, T(0)};
  } else {
    static_assert(kObjective == config::kObjectiveKlCov, "unknown objective");
    // -A rho + s c |l - l_old|; |x|'s derivative is sign(x), 0 at 0.
    const T penalty = selected * options[config::kOptionPpoKlCoef];
    const T log_ratio = logprob - old_logprob;
    const T sign = log_ratio > 0 ? T(1) : (log_ratio < 0 ? T(-1) : T(0));
    return {-advantage * ratio + penalty * (log_ratio < 0 ? -log_ratio : log_ratio), -advantage, penalty * sign};
  }
}

// Calls `f` with the objective as a compile-time constant (a std::integral_constant): one
// instantiation per code of config.OBJECTIVES, so that each objective's token loops are
// compiled, and vectorised, for it alone.
template <int64_t kCode = 0, typename F>
HADW_ALWAYS_INLINE decltype(auto) with_objective(int64_t objective, F&& f) {
  if constexpr (kCode + 1 < config::kObjectiveCount) {
    if (objective != kCode) {
      return with_objective<kCode + 1>(objective, std::forward<F>(f));
    }
  }
  return f(std::integral_constant<int64_t, kCode>{});
}

// The objective's response step (objectives.table.RESPONSE_STEPS), a kResponseStep code.
template <int64_t kObjective>
constexpr int64_t kResponseStep = config::kObjectiveResponseStep[kObjective];

// A token's log-ratio as its response's mean takes it, and whether it passes its
// gradient: as it is, unless the objective's response step is clipped_log_ratio_mean, whose
// clip is the objective's formula (objectives.RESPONSE_FORMULAS), one branch each. GMPO
// clips it to [-epsilon_low, epsilon_high] on the side its advantage makes harmful (above
// for A > 0, below for A < 0; 0 for A = 0, NaN kept), and the clip passes where the bound
// does not bind (objectives.gmpo_log_ratio).
template <typename T>
struct ResponseLogRatio {
  T value;
  bool passes;
};

template <int64_t kObjective, typename T>
HADW_ALWAYS_INLINE ResponseLogRatio<T> response_log_ratio(T log_ratio, T advantage,
                                                          const ObjectiveOptions<T>& options) {
  if constexpr (kResponseStep<kObjective> != config::kResponseStepClippedLogRatioMean) {
    return {log_ratio, true};
  } else if constexpr (kObjective == config::kObjectiveGmpo) {
    const T below_high = log_ratio > options.log_ratio_high ? options.log_ratio_high : log_ratio;
    const T above_low = log_ratio < options.log_ratio_low ? options.log_ratio_low : log_ratio;
    const T value = advantage > 0 ? below_high : (advantage < 0 ? above_low : T(0) * log_ratio);
    const bool passes = (advantage > 0 && log_ratio <= options.log_ratio_high) ||
                        (advantage < 0 && log_ratio >= options.log_ratio_low);
    return {value, passes};
  } else {
    static_assert(kObjective == config::kObjectiveGmpo,
                  "an objective whose response step is clipped_log_ratio_mean: teach response_log_ratio its clip");
  }
}

// VESPO's phi = w^k exp(lambda (1 - w)), log w the response's summed log-ratio clamped
// (objectives.vespo_weight); 0 where it is not finite, as TRL's nan_to_num.
inline double vespo_weight(double summed_log_ratio, double k, double lambda) {
  const double log_weight = clamp_keep_nan(summed_log_ratio, config::kVespoLogWeightMin, config::kLogRatioClamp);
  const double phi = std::exp(lambda + k * log_weight - lambda * std::exp(log_weight));
  return std::isfinite(phi) ? phi : 0.0;
}

// The weights of a response whose objective's response step is log_ratio_sum, from the sum
// of its tokens' clamped log-ratios, in double from the exact options: the objective's
// formula (objectives.RESPONSE_FORMULAS), one branch each.
template <int64_t kObjective, typename T>
ResponseWeights<T> response_weights(double summed_log_ratio, const ObjectiveOptions<T>& options) {
  if constexpr (kObjective == config::kObjectiveVespo) {
    const double* option = options.exact;
    return {static_cast<T>(vespo_weight(summed_log_ratio, option[config::kOptionVespoKPos],
                                        option[config::kOptionVespoLambdaPos])),
            static_cast<T>(vespo_weight(summed_log_ratio, option[config::kOptionVespoKNeg],
                                        option[config::kOptionVespoLambdaNeg]))};
  } else {
    static_assert(kObjective == config::kObjectiveVespo,
                  "an objective whose response step is log_ratio_sum: teach response_weights its weight");
  }
}

template <typename T>
struct PolicyTerm {
  T value;  // the token's objective
  T slope;  // d value / d logp
  T ratio;  // rho, for the metrics
};

// The objective of a token in the token ratio form: rho = exp(log-ratio clamped to
// +-LOG_RATIO_CLAMP), the clamp passing the gradient on its closed interval only, and
// d rho / d logp = rho.
template <int64_t kObjective, typename T>
HADW_ALWAYS_INLINE PolicyTerm<T> token_policy_term(T logprob, T old_logprob, T advantage, T selected,
                                                   const ObjectiveOptions<T>& options) {
  const T limit = static_cast<T>(config::kLogRatioClamp);
  const T log_ratio = logprob - old_logprob;
  const T ratio = vector_exp(clamp_keep_nan(log_ratio, -limit, limit));
  const ObjectiveTerm<T> term =
      objective_term<kObjective>(ratio, advantage, logprob, old_logprob, selected, ResponseWeights<T>{}, options);
  const T through_ratio = in_closed(log_ratio, -limit, limit) ? term.d_ratio * ratio : T(0);
  return {term.value, through_ratio + term.d_logprob, ratio};
}

// token_policy_term for an objective code known only at run time (one token at a time);
// the objective must take the token ratio form (config::kObjectiveTakesRatioLevel).
template <typename T>
PolicyTerm<T> token_policy_term(int64_t objective, T logprob, T old_logprob, T advantage, T selected,
                                const ObjectiveOptions<T>& options) {
  return with_objective(objective, [&](auto code) {
    return token_policy_term<decltype(code)::value>(logprob, old_logprob, advantage, selected, options);
  });
}

// expm1(x) - x of the clamped log-ratio: the approx_kl metric's k3 of KL(pi_old || pi).
template <typename T>
HADW_ALWAYS_INLINE T approx_kl_term(T log_ratio) {
  const T limit = static_cast<T>(config::kLogRatioClamp);
  return clamped_exp_minus_one_minus_x(log_ratio, limit);
}

template <typename T>
struct Term {
  T value;
  T slope;  // d value / d (its argument)
};

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
