// CPU kernel of hadw_cpp::surrogate_loss (docs/math.md, sections 2, 4 and 5): the policy
// objective with HA-DW as config.LossConfig describes it (the options arrive resolved:
// aggregation mode, KL estimator, objective and ratio form as their index in
// config.AGG_MODES / KL_ESTIMATORS / OBJECTIVE_NAMES / RATIO_LEVELS), in one pass over
// the tokens that writes the loss, its gradient with respect to the log-probs and the
// entropy, and the metrics (config.METRIC_NAMES, indexed by name through the generated
// header); a sequence ratio first sweeps its response for what the tokens share (the
// mean log-ratio, and in the sequence form the sum of the tokens' d l / d rho). The
// tokens come flat, [N], in segments of one response each (cu_seqlens,
// hadw_kernels/layout.py): a padded [B, T] batch is B segments of T tokens.
//
// The loss is the end of the graph, so its gradient is formed here and autograd only
// scales it by the upstream scalar (hadw_kernels/ops/autograd.py). Per-token math
// (token_math.h) runs in the compute type (fp32, fp64 for fp64 log-probs); every sum
// runs in double. Responses are processed in parallel and their sums added in response
// order, so the results do not depend on the thread count. Masked positions are never
// read into arithmetic: padding may hold inf or NaN.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ne.h>
#include <ATen/ops/promote_types.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "hadw_config.h"
#include "kernels.h"
#include "token_math.h"

namespace hadw {
namespace {

static_assert(config::kMetricCount == 8, "config.METRIC_NAMES changed: fill the new metric in surrogate.cpp");
static_assert(config::kResponseStepCount == 3,
              "objectives.table.RESPONSE_STEPS changed: teach sequence_ratio (csrc/surrogate.cpp) the new one");

double sign(double value) { return static_cast<double>((value > 0) - (value < 0)); }

// A_i for every response from rewards, and the group statistics.
struct Advantages {
  std::vector<double> advantage;
  bool has_groups = false;
  double phi_sum = 0;
  int64_t groups = 0;
  int64_t degenerate_groups = 0;
};

// Read in place, not through a double copy: a small call's host time is counted in
// the tensors it forms (docs/benchmarks.md, "Host time of a small call").
std::vector<double> to_doubles(const at::Tensor& tensor) {
  const at::Tensor values = tensor.contiguous();
  std::vector<double> result(values.numel());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "to_doubles", [&] {
    const scalar_t* data = values.const_data_ptr<scalar_t>();
    for (size_t i = 0; i < result.size(); ++i) {
      result[i] = static_cast<double>(data[i]);
    }
  });
  return result;
}

// Per group of contiguous rewards: its count, sum, mean and noise (the unbiased variance over
// n - 1: the sampling variance of a leave-one-out mean), and whether its rewards are all equal.
struct GroupFigures {
  double total = 0;
  double mean = 0;
  double squares = 0;
  bool degenerate = false;
};

GroupFigures group_figures(const double* group, int64_t group_size) {
  GroupFigures figures;
  double lowest = group[0];
  double highest = group[0];
  for (int64_t i = 0; i < group_size; ++i) {
    figures.total += group[i];
    lowest = std::min(lowest, group[i]);
    highest = std::max(highest, group[i]);
  }
  figures.mean = figures.total / static_cast<double>(group_size);
  for (int64_t i = 0; i < group_size; ++i) {
    figures.squares += (group[i] - figures.mean) * (group[i] - figures.mean);
  }
  // min == max, not std == 0: the mean of equal non-dyadic rewards need not equal them.
  figures.degenerate = lowest == highest;
  return figures;
}

double noise_of(const GroupFigures& figures, int64_t group_size) {
  const double less_one = static_cast<double>(group_size - 1);
  return figures.squares / less_one / less_one;
}

// tables.estimators.BATCH_TOTALS of the call's groups: the batch James-Stein shrinks over
// when the caller gives none.
std::array<double, config::kTotalCount> call_totals(const std::vector<double>& reward, int64_t group_size) {
  std::array<double, config::kTotalCount> totals{};
  const int64_t batch = static_cast<int64_t>(reward.size());
  for (int64_t first = 0; first < batch; first += group_size) {
    const GroupFigures figures = group_figures(reward.data() + first, group_size);
    totals[config::kTotalGroups] += 1;
    totals[config::kTotalResponses] += static_cast<double>(group_size);
    totals[config::kTotalRewards] += figures.total;
    totals[config::kTotalNoise] += noise_of(figures, group_size);
    totals[config::kTotalMeans] += figures.mean;
    totals[config::kTotalSquaredMeans] += figures.mean * figures.mean;
  }
  return totals;
}

// James-Stein's baseline from the group's own (leave-one-out) one and the batch's totals less
// this group's (tables/estimators.py, james_stein_weights).
double shrunk(double own, const std::array<double, config::kTotalCount>& totals, const GroupFigures& figures,
              int64_t group_size) {
  const double others = std::max(totals[config::kTotalGroups] - 1, 1.0);
  const double other_noise = (totals[config::kTotalNoise] - noise_of(figures, group_size)) / others;
  const double other_mean_of_means = (totals[config::kTotalMeans] - figures.mean) / others;
  const double other_spread = std::max(
      (totals[config::kTotalSquaredMeans] - figures.mean * figures.mean) / others -
          other_mean_of_means * other_mean_of_means,
      0.0);
  const double spread = other_noise + other_spread;
  const double shrinkage = spread > 0 ? other_noise / spread : 0.0;
  const double other_rewards = (totals[config::kTotalRewards] - figures.total) /
                               std::max(totals[config::kTotalResponses] - static_cast<double>(group_size), 1.0);
  return (1 - shrinkage) * own + shrinkage * other_rewards;
}

// A_hat_i * Phi_i by the estimator's row (tables/estimators.py: its scope and whether the
// response's own reward leaves its group; hadw_kernels/advantage/group.py), in double.
Advantages group_advantages(const at::Tensor& rewards, int64_t group_size, int64_t estimator, bool normalize_std,
                            double std_eps, const std::optional<at::Tensor>& anchor, double lambda_scale,
                            const std::optional<at::Tensor>& batch_totals, const std::optional<at::Tensor>& prior) {
  TORCH_CHECK(estimator >= 0 && estimator < config::kEstimatorCount,
              "hadw_cpp::surrogate_loss: unknown advantage_estimator code ", estimator);
  const config::Estimator row = config::kEstimators[estimator];
  Advantages result;
  result.has_groups = true;
  const std::vector<double> reward = to_doubles(rewards);
  std::optional<double> belief;
  if (anchor.has_value()) {
    TORCH_CHECK(anchor->numel() == 1, "hadw_cpp::surrogate_loss: anchor must be a scalar, got shape ",
                anchor->sizes());
    // The reference rounds the anchor to the rewards' compute dtype (at least fp32).
    const auto reward_type = at::promote_types(rewards.scalar_type(), at::kFloat);
    belief = anchor->detach().reshape({}).to(reward_type).to(at::kDouble).item<double>();
  }
  const int64_t batch = static_cast<int64_t>(reward.size());
  std::array<double, config::kTotalCount> totals{};
  if (row.scope == config::kScopeBatch) {
    if (batch_totals.has_value()) {
      TORCH_CHECK(batch_totals->numel() == config::kTotalCount, "hadw_cpp::surrogate_loss: batch_totals must be [",
                  config::kTotalCount, "], got shape ", batch_totals->sizes());
      const std::vector<double> given = to_doubles(*batch_totals);
      std::copy(given.begin(), given.end(), totals.begin());
    } else {
      totals = call_totals(reward, group_size);
    }
  }
  std::vector<double> pseudo_counts;
  if (row.scope == config::kScopeHistory) {
    TORCH_CHECK(prior.has_value() && prior->dim() == 2 && prior->size(0) == batch && prior->size(1) == 2,
                "hadw_cpp::surrogate_loss: the history's estimator needs prior [", batch, ", 2]");
    pseudo_counts = to_doubles(*prior);
  }
  result.advantage.resize(batch);
  result.groups = batch / group_size;
  for (int64_t first = 0; first < batch; first += group_size) {
    const double* group = reward.data() + first;
    const GroupFigures figures = group_figures(group, group_size);
    const double std_dev = std::sqrt(figures.squares / static_cast<double>(group_size - 1));
    result.degenerate_groups += figures.degenerate;
    for (int64_t i = 0; i < group_size; ++i) {
      double advantage_hat = group[i] - figures.mean;
      if (row.scope != config::kScopeGroup || row.leave_one_out) {
        double sum = figures.total;
        double count = static_cast<double>(group_size);
        if (row.leave_one_out) {
          sum -= group[i];
          count -= 1;
        }
        if (row.scope == config::kScopeHistory) {
          const double alpha = pseudo_counts[2 * (first + i)];
          const double beta = pseudo_counts[2 * (first + i) + 1];
          sum += alpha;
          count += alpha + beta;
        }
        double baseline = sum / count;
        if (row.scope == config::kScopeBatch) {
          baseline = shrunk(baseline, totals, figures, group_size);
        }
        advantage_hat = group[i] - baseline;
      }
      if (normalize_std) {
        advantage_hat /= std_dev + std_eps;
      }
      if (row.scope == config::kScopeGroup && figures.degenerate) {
        advantage_hat = 0.0;
      }
      double phi = 1.0;
      if (belief.has_value()) {
        const double difficulty = figures.mean - *belief;
        phi = lambda_scale * std::exp(-sign(advantage_hat) * sign(difficulty) * std::abs(difficulty));
      }
      result.advantage[first + i] = advantage_hat * phi;
      result.phi_sum += phi;
    }
  }
  return result;
}

// Inputs of the token loop: [N] contiguous in the compute type unless noted, in S
// segments (hadw_kernels/layout.py): segment i is tokens offsets[i] .. offsets[i+1].
template <typename T>
struct Problem {
  const int64_t* offsets;  // [S+1]
  const T* logprobs;
  const T* old_logprobs;
  const uint8_t* mask;  // bool storage read as bytes
  const T* ref_logprobs;  // null unless beta > 0
  const T* importance;    // importance weights per token, or null
  const T* entropy;       // or null
  const T* selected;      // the objective's selection per token (0 or 1), or null: none
  const T* token_advantage;  // the caller's advantages per token, or null
  const double* response_advantage;  // [S] A_i (from rewards, or the caller's), or null
  const double* agg_weight;  // [S] w_i: a valid token's weight in the aggregate
  const int64_t* lengths;      // [S] valid tokens per response
  int64_t objective;    // a config::kObjective code
  int64_t ratio_level;  // a config::kRatioLevel code
  ObjectiveOptions<T> options;
  T beta;
  int64_t kl_estimator;
  T entropy_coef;
  T* grad_logprobs;
  T* grad_entropy;  // or null
};

// What one response adds to the loss and to the metric sums.
struct ResponseSums {
  double loss = 0;
  double ratio_count = 0;  // tokens (token ratio) or 1 (a non-empty response, sequence ratios)
  double clipped_low = 0;
  double clipped_high = 0;
  double ratio = 0;
  double approx_kl = 0;
  double ref_kl = 0;
  double entropy = 0;

  void add(const ResponseSums& other) {
    loss += other.loss;
    ratio_count += other.ratio_count;
    clipped_low += other.clipped_low;
    clipped_high += other.clipped_high;
    ratio += other.ratio;
    approx_kl += other.approx_kl;
    ref_kl += other.ref_kl;
    entropy += other.entropy;
  }
};

// Tokens per chunk of a response: the chunk's per-token values stay in L1 between the
// passes below, each a loop the compiler vectorises.
constexpr int64_t kChunk = 256;

// The passes below are maps (no reductions: GCC does not vectorise the token math with
// an `omp simd reduction` around it) followed by masked sums over the chunk.
template <typename T>
HADW_ALWAYS_INLINE T masked_sum(const T* values, const uint8_t* mask, int64_t count) {
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < count; ++t) {
    // Loaded before the select: a load under the condition keeps GCC from vectorising.
    const T value = values[t];
    sum += mask[t] != 0 ? value : T(0);
  }
  return sum;
}

// The same sum in double, for what a response's tokens share (its mean log-ratio, the
// sum of its advantages, its share of d l / d rho): one rounding, at the end.
template <typename T>
HADW_ALWAYS_INLINE double masked_sum_in_double(const T* values, const uint8_t* mask, int64_t count) {
  double sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < count; ++t) {
    const double value = values[t];
    sum += mask[t] != 0 ? value : 0.0;
  }
  return sum;
}

// Valid tokens whose ratio lies below `low` with a negative advantage (the clip_frac_low
// metric's) and above `high` with a positive one (clip_frac_high's).
template <typename T>
HADW_ALWAYS_INLINE void masked_count_clipped(const T* ratio, const T* advantage, const uint8_t* mask, int64_t count,
                                             T low, T high, ResponseSums& sums) {
  T below = 0;
  T above = 0;
#pragma omp simd reduction(+ : below, above)
  for (int64_t t = 0; t < count; ++t) {
    const T value = ratio[t];
    const T signed_by = advantage[t];
    below += (mask[t] != 0 && value < low && signed_by < 0) ? T(1) : T(0);
    above += (mask[t] != 0 && value > high && signed_by > 0) ? T(1) : T(0);
  }
  sums.clipped_low += below;
  sums.clipped_high += above;
}

// Pass 1, token ratio: each token's objective, its d / d logp, its ratio and approx_kl.
template <int64_t kObjective, typename T>
HADW_ALWAYS_INLINE void token_ratio_pass(const T* logprobs, const T* old_logprobs, const T* advantage,
                                         const T* selected, int64_t count, const ObjectiveOptions<T>& options,
                                         T* value, T* slope, T* ratio, T* approx_kl) {
#pragma omp simd
  for (int64_t t = 0; t < count; ++t) {
    const T log_ratio = logprobs[t] - old_logprobs[t];
    const PolicyTerm<T> term =
        token_policy_term<kObjective>(logprobs[t], old_logprobs[t], advantage[t], selected[t], options);
    value[t] = term.value;
    slope[t] = term.slope;
    ratio[t] = term.ratio;
    approx_kl[t] = approx_kl_term(log_ratio);
  }
}

// Pass 1, sequence ratios: every token's ratio is its response's s_i. `own_ratio_slope` is
// d rho / d logp_t through the token's own log-prob: s_i in the gspo_token form (where the
// clamp passes), 0 in the sequence form, whose gradient through s_i is shared_pass's.
template <int64_t kObjective, typename T>
HADW_ALWAYS_INLINE void sequence_ratio_pass(const T* logprobs, const T* old_logprobs, const T* advantage,
                                            int64_t count, T ratio, T own_ratio_slope,
                                            const ResponseWeights<T>& weights, const ObjectiveOptions<T>& options,
                                            T* value, T* slope, T* approx_kl) {
#pragma omp simd
  for (int64_t t = 0; t < count; ++t) {
    const ObjectiveTerm<T> term =
        objective_term<kObjective>(ratio, advantage[t], logprobs[t], old_logprobs[t], T(0), weights, options);
    value[t] = term.value;
    slope[t] = term.d_ratio * own_ratio_slope + term.d_logprob;
    approx_kl[t] = approx_kl_term(logprobs[t] - old_logprobs[t]);
  }
}

// Each token's log-ratio as the response's mean takes it (response_log_ratio), and, for a
// log_ratio_sum step's weight, the log-ratio clamped to +-LOG_RATIO_CLAMP.
template <int64_t kObjective, typename T>
HADW_ALWAYS_INLINE void response_log_ratio_pass(const T* logprobs, const T* old_logprobs, const T* advantage,
                                                int64_t count, const ObjectiveOptions<T>& options, T* log_ratio,
                                                T* clamped_log_ratio) {
  const T limit = static_cast<T>(config::kLogRatioClamp);
#pragma omp simd
  for (int64_t t = 0; t < count; ++t) {
    const T raw = logprobs[t] - old_logprobs[t];
    log_ratio[t] = response_log_ratio<kObjective>(raw, advantage[t], options).value;
    if constexpr (kResponseStep<kObjective> == config::kResponseStepLogRatioSum) {
      clamped_log_ratio[t] = clamp_keep_nan(raw, -limit, limit);
    }
  }
}

// d l_t / d rho at the response's ratio, times the token's importance weight (or 1).
template <int64_t kObjective, typename T>
HADW_ALWAYS_INLINE void ratio_slope_pass(const T* logprobs, const T* advantage, const T* importance, int64_t count,
                                         T ratio, const ResponseWeights<T>& weights,
                                         const ObjectiveOptions<T>& options, T* d_ratio) {
#pragma omp simd
  for (int64_t t = 0; t < count; ++t) {
    const T weight = importance == nullptr ? T(1) : importance[t];
    d_ratio[t] =
        weight * objective_term<kObjective>(ratio, advantage[t], logprobs[t], logprobs[t], T(0), weights, options)
                     .d_ratio;
  }
}

// The sequence form's gradient through s_i, shared by the response's tokens (each where
// its log-ratio passes the objective's clip, under clipped_log_ratio_mean).
template <int64_t kObjective, typename T>
HADW_ALWAYS_INLINE void shared_pass(const T* logprobs, const T* old_logprobs, const T* advantage, int64_t count,
                                    T shared, const ObjectiveOptions<T>& options, T* slope) {
#pragma omp simd
  for (int64_t t = 0; t < count; ++t) {
    const bool passes = response_log_ratio<kObjective>(logprobs[t] - old_logprobs[t], advantage[t], options).passes;
    slope[t] += passes ? shared : T(0);
  }
}

template <typename T>
HADW_ALWAYS_INLINE void importance_pass(const T* weights, int64_t count, T* value, T* slope) {
#pragma omp simd
  for (int64_t t = 0; t < count; ++t) {
    value[t] *= weights[t];
    slope[t] *= weights[t];
  }
}

template <int64_t kEstimator, typename T>
HADW_ALWAYS_INLINE void kl_pass(const T* logprobs, const T* ref_logprobs, int64_t count, T beta, T* value, T* slope,
                                T* kl_value) {
#pragma omp simd
  for (int64_t t = 0; t < count; ++t) {
    const Term<T> kl = kl_term<kEstimator>(logprobs[t], ref_logprobs[t]);
    value[t] += beta * kl.value;
    slope[t] += beta * kl.slope;
    kl_value[t] = kl.value;
  }
}

// Without a coefficient the entropy only feeds its metric: a NaN there must not reach
// the loss.
template <typename T>
HADW_ALWAYS_INLINE void entropy_pass(const T* entropy, const uint8_t* mask, int64_t count, T coefficient, T weight,
                                     T* value, T* grad_entropy) {
  const T grad = coefficient > 0 ? -coefficient * weight : T(0);
  if (coefficient > 0) {
#pragma omp simd
    for (int64_t t = 0; t < count; ++t) {
      value[t] -= coefficient * entropy[t];
    }
  }
#pragma omp simd
  for (int64_t t = 0; t < count; ++t) {
    grad_entropy[t] = mask[t] != 0 ? grad : T(0);
  }
}

// Masked positions (which may hold inf or NaN) are selected out, never multiplied by 0.
template <typename T>
HADW_ALWAYS_INLINE void gradient_pass(const uint8_t* mask, int64_t count, T weight, const T* slope, T* grad) {
#pragma omp simd
  for (int64_t t = 0; t < count; ++t) {
    grad[t] = mask[t] != 0 ? slope[t] * weight : T(0);
  }
}

// What the tokens of a response share in the sequence ratio forms (docs/math.md, section 5).
template <typename T>
struct SequenceRatio {
  T ratio = 0;                // s_i, also the metrics' ratio
  T own_ratio_slope = 0;      // d rho_t / d logp_t through the token's own log-prob
  T shared = 0;               // the sequence form's gradient through s_i, per token
  ResponseWeights<T> weights;
};

// The advantage of each token of a chunk: the caller's, or the response's A_i repeated
// (`repeated`, kChunk of them).
template <typename T>
HADW_ALWAYS_INLINE const T* chunk_advantage(const Problem<T>& problem, int64_t position, const T* repeated) {
  return problem.token_advantage != nullptr ? problem.token_advantage + position : repeated;
}

// The sequence ratio of a non-empty response: a first sweep for its mean log-ratio (and,
// under log_ratio_sum, its summed one) and the sign of its advantage, which the clip
// fractions count it by; in the sequence form a second for sum_t iw_t dl/drho(s_i, A_t),
// whose share reaches every token through s_i.
template <int64_t kObjective, typename T>
HADW_ALWAYS_INLINE SequenceRatio<T> sequence_ratio(const Problem<T>& problem, int64_t row, const T* repeated,
                                                   ResponseSums& sums) {
  const int64_t offset = problem.offsets[row];
  const int64_t width = problem.offsets[row + 1] - offset;
  const uint8_t* mask = problem.mask + offset;
  const double length = static_cast<double>(problem.lengths[row]);
  double log_ratio_sum = 0;
  double clamped_log_ratio_sum = 0;
  double advantage_sum = 0;
  T log_ratio[kChunk];
  T clamped_log_ratio[kChunk];
  for (int64_t start = 0; start < width; start += kChunk) {
    const int64_t count = std::min(kChunk, width - start);
    const T* advantage = chunk_advantage(problem, offset + start, repeated);
    response_log_ratio_pass<kObjective>(problem.logprobs + offset + start, problem.old_logprobs + offset + start,
                                        advantage, count, problem.options, log_ratio, clamped_log_ratio);
    log_ratio_sum += masked_sum_in_double(log_ratio, mask + start, count);
    if constexpr (kResponseStep<kObjective> == config::kResponseStepLogRatioSum) {
      clamped_log_ratio_sum += masked_sum_in_double(clamped_log_ratio, mask + start, count);
    }
    advantage_sum += masked_sum_in_double(advantage, mask + start, count);
  }
  const double limit = config::kLogRatioClamp;
  const T mean_log_ratio = static_cast<T>(log_ratio_sum / length);
  SequenceRatio<T> sequence;
  sequence.ratio = vector_exp(clamp_keep_nan(mean_log_ratio, static_cast<T>(-limit), static_cast<T>(limit)));
  const bool passes = in_closed(mean_log_ratio, static_cast<T>(-limit), static_cast<T>(limit));
  if (problem.ratio_level == config::kRatioLevelGspoToken && passes) {
    sequence.own_ratio_slope = sequence.ratio;
  }
  if constexpr (kResponseStep<kObjective> == config::kResponseStepLogRatioSum) {
    sequence.weights = response_weights<kObjective>(clamped_log_ratio_sum, problem.options);
  }
  if (problem.ratio_level == config::kRatioLevelSequence && passes) {
    double slope_sum = 0;
    T d_ratio[kChunk];
    for (int64_t start = 0; start < width; start += kChunk) {
      const int64_t count = std::min(kChunk, width - start);
      ratio_slope_pass<kObjective>(problem.logprobs + offset + start, chunk_advantage(problem, offset + start, repeated),
                                   problem.importance == nullptr ? nullptr : problem.importance + offset + start,
                                   count, sequence.ratio, sequence.weights, problem.options, d_ratio);
      slope_sum += masked_sum_in_double(d_ratio, mask + start, count);
    }
    sequence.shared = static_cast<T>(slope_sum * static_cast<double>(sequence.ratio) / length);
  }
  sums.ratio_count = 1;
  sums.ratio = sequence.ratio;
  sums.clipped_low = (sequence.ratio < problem.options.ratio_low && advantage_sum < 0);
  sums.clipped_high = (sequence.ratio > problem.options.ratio_high && advantage_sum > 0);
  return sequence;
}

// The objective's part of a chunk of `count` tokens from `position`: each token's l_t and
// d / d logp times its importance weight (plus the sequence form's share through s_i),
// its ratio (token ratio only) and approx_kl.
template <int64_t kObjective, typename T>
HADW_ALWAYS_INLINE void policy_chunk(const Problem<T>& problem, int64_t position, int64_t count, const T* advantage,
                                     const SequenceRatio<T>& sequence, T* value, T* slope, T* ratio, T* approx_kl) {
  const T* logprobs = problem.logprobs + position;
  const T* old_logprobs = problem.old_logprobs + position;
  if (problem.ratio_level == config::kRatioLevelToken) {
    static const T kNoneSelected[kChunk] = {};
    const T* selected = problem.selected == nullptr ? kNoneSelected : problem.selected + position;
    token_ratio_pass<kObjective>(logprobs, old_logprobs, advantage, selected, count, problem.options, value, slope,
                                 ratio, approx_kl);
  } else {
    sequence_ratio_pass<kObjective>(logprobs, old_logprobs, advantage, count, sequence.ratio,
                                    sequence.own_ratio_slope, sequence.weights, problem.options, value, slope,
                                    approx_kl);
  }
  if (problem.importance != nullptr) {
    importance_pass(problem.importance + position, count, value, slope);
  }
  if (sequence.shared != 0) {
    shared_pass<kObjective>(logprobs, old_logprobs, advantage, count, sequence.shared, problem.options, slope);
  }
}

// One response: its tokens' gradients, and what it adds to the loss and the metrics.
// Inlined into process_rows, so that each instruction-set clone has its own copy.
template <typename T>
HADW_ALWAYS_INLINE ResponseSums process_response(const Problem<T>& problem, int64_t row) {
  const int64_t offset = problem.offsets[row];
  const int64_t width = problem.offsets[row + 1] - offset;
  const T* logprobs = problem.logprobs + offset;
  const uint8_t* mask = problem.mask + offset;
  const int64_t length = problem.lengths[row];
  const T agg_weight = static_cast<T>(problem.agg_weight[row]);
  const bool token_ratio = problem.ratio_level == config::kRatioLevelToken;
  ResponseSums sums;

  T repeated[kChunk];  // A_i for every token, when the advantages are per response
  if (problem.response_advantage != nullptr) {
    std::fill(repeated, repeated + std::min(width, kChunk), static_cast<T>(problem.response_advantage[row]));
  }
  SequenceRatio<T> sequence;
  if (token_ratio) {
    sums.ratio_count = static_cast<double>(length);
  } else if (length > 0) {
    sequence = with_objective(problem.objective, [&](auto objective) HADW_ALWAYS_INLINE_LAMBDA {
      return sequence_ratio<decltype(objective)::value>(problem, row, repeated, sums);
    });
  }

  T value[kChunk];
  T slope[kChunk];
  T ratio[kChunk];
  T scratch[kChunk];  // approx_kl, then the KL estimate
  double token_terms = 0;
  for (int64_t start = 0; start < width; start += kChunk) {
    const int64_t count = std::min(kChunk, width - start);
    const uint8_t* chunk_mask = mask + start;
    const T* chunk_logprobs = logprobs + start;
    const T* advantage = chunk_advantage(problem, offset + start, repeated);
    with_objective(problem.objective, [&](auto objective) HADW_ALWAYS_INLINE_LAMBDA {
      policy_chunk<decltype(objective)::value>(problem, offset + start, count, advantage, sequence, value, slope,
                                               ratio, scratch);
    });
    if (token_ratio) {
      sums.ratio += masked_sum(ratio, chunk_mask, count);
      masked_count_clipped(ratio, advantage, chunk_mask, count, problem.options.ratio_low, problem.options.ratio_high,
                           sums);
    }
    sums.approx_kl += masked_sum(scratch, chunk_mask, count);
    if (problem.ref_logprobs != nullptr) {
      const T* ref_logprobs = problem.ref_logprobs + offset + start;
      switch (problem.kl_estimator) {  // the estimator as a constant of each loop
        case config::kKlK1:
          kl_pass<config::kKlK1>(chunk_logprobs, ref_logprobs, count, problem.beta, value, slope, scratch);
          break;
        case config::kKlK2:
          kl_pass<config::kKlK2>(chunk_logprobs, ref_logprobs, count, problem.beta, value, slope, scratch);
          break;
        case config::kKlK3:
          kl_pass<config::kKlK3>(chunk_logprobs, ref_logprobs, count, problem.beta, value, slope, scratch);
          break;
        default:
          kl_pass<config::kKlAbs>(chunk_logprobs, ref_logprobs, count, problem.beta, value, slope, scratch);
          break;
      }
      sums.ref_kl += masked_sum(scratch, chunk_mask, count);
    }
    if (problem.entropy != nullptr) {
      const T* entropy = problem.entropy + offset + start;
      sums.entropy += masked_sum(entropy, chunk_mask, count);
      entropy_pass(entropy, chunk_mask, count, problem.entropy_coef, agg_weight, value,
                   problem.grad_entropy + offset + start);
    }
    gradient_pass(chunk_mask, count, agg_weight, slope, problem.grad_logprobs + offset + start);
    token_terms += masked_sum(value, chunk_mask, count);
  }
  sums.loss = token_terms * problem.agg_weight[row];
  return sums;
}

// The token loop for each instruction set (HADW_VECTOR_CLONES): fp32 is the hot path.
HADW_VECTOR_CLONES void process_rows(const Problem<float>& problem, int64_t first, int64_t last,
                                     ResponseSums* sums) {
  for (int64_t row = first; row < last; ++row) {
    sums[row] = process_response(problem, row);
  }
}

void process_rows(const Problem<double>& problem, int64_t first, int64_t last, ResponseSums* sums) {
  for (int64_t row = first; row < last; ++row) {
    sums[row] = process_response(problem, row);
  }
}

// The kernels run below autograd (the losses attach the gradients they form), so no
// input is detached: a detach forms a tensor, and none is formed where the input already
// is contiguous in the compute type.
at::Tensor compute_copy(const at::Tensor& tensor, at::ScalarType compute) {
  return tensor.to(compute).contiguous();
}

// Whether the aggregation divides by the batch's valid tokens (token-mean without a
// normaliser): the op's gradients then leave that 1 / N_tok to its grad_scale output
// (hadw_kernels/formulas/aggregation.py: counts_batch_tokens; the contract in ops/schemas.py).
bool counts_batch_tokens(int64_t loss_agg_mode, std::optional<double> loss_normalizer) {
  return config::kAggregations[loss_agg_mode].denominator == config::kDenominatorTokens &&
         !loss_normalizer.has_value();
}

// w_i of config.AGG_MODES, from the mode's row of config.AGGREGATIONS
// (hadw_kernels/formulas/aggregation.py: agg_weights), but for the count of the batch's valid
// tokens that grad_scale holds (counts_batch_tokens). The constant L of times_max_length
// arrives resolved (the losses default it to a padded batch's width).
std::vector<double> agg_weights(const std::vector<int64_t>& lengths, int64_t loss_agg_mode,
                                std::optional<double> loss_normalizer, std::optional<int64_t> max_length) {
  const config::Aggregation& rule = config::kAggregations[loss_agg_mode];
  const int64_t batch = static_cast<int64_t>(lengths.size());
  double count = 1.0;
  switch (rule.denominator) {
    case config::kDenominatorTokens:  // grad_scale's
    case config::kDenominatorOne:
      count = 1.0;
      break;
    case config::kDenominatorResponses:
      count = static_cast<double>(std::max<int64_t>(batch, 1));
      break;
    default:
      TORCH_CHECK(false, "hadw_cpp::surrogate_loss: config.AGGREGATIONS names an unknown denominator ",
                  rule.denominator);
  }
  double base = loss_normalizer.value_or(count);
  if (rule.times_max_length) {
    TORCH_CHECK(max_length.has_value() && *max_length >= 1, "hadw_cpp::surrogate_loss: loss_agg_mode ",
                loss_agg_mode, " needs max_response_length (the constant L it divides by)");
    base *= static_cast<double>(*max_length);
  }
  std::vector<double> weights(batch);
  for (int64_t row = 0; row < batch; ++row) {
    weights[row] = rule.per_response_mean ? 1.0 / (static_cast<double>(std::max<int64_t>(lengths[row], 1)) * base)
                                          : 1.0 / base;
  }
  return weights;
}

// Segments per task of the parallel loops: about 16k tokens at the mean segment length.
int64_t segment_grain(int64_t tokens, int64_t segments) {
  const int64_t mean_length = tokens / std::max<int64_t>(segments, 1);
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(mean_length, 1));
}

// The op's options that the token loop reads, as the schema gives them (LossConfig.kernel_options).
struct Options {
  int64_t loss_agg_mode;
  int64_t ratio_level;
  int64_t objective;
  double epsilon_low;
  double epsilon_high;
  c10::ArrayRef<double> objective_options;
  double beta;
  int64_t kl_estimator;
  double entropy_coef;
  std::optional<double> loss_normalizer;
  std::optional<int64_t> max_response_length;
};

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> surrogate_impl(
    const at::Tensor& logprobs_in, const at::Tensor& old_logprobs_in, const at::Tensor& response_mask,
    const std::vector<int64_t>& offsets, const std::optional<at::Tensor>& ref_logprobs_in,
    const std::optional<at::Tensor>& importance_weights_in, const std::optional<at::Tensor>& entropy_in,
    const std::optional<at::Tensor>& selected_in, const Advantages& advantages, const std::optional<at::Tensor>& token_advantages_in, at::ScalarType compute,
    const Options& call) {
  const int64_t tokens_in = logprobs_in.size(0);
  const int64_t segments = static_cast<int64_t>(offsets.size()) - 1;
  const auto options = logprobs_in.options().dtype(compute);
  at::Tensor grad_logprobs = at::empty({tokens_in}, options);
  at::Tensor grad_entropy = entropy_in.has_value() ? at::empty(entropy_in->sizes(), options) : at::empty({0}, options);
  at::Tensor metrics = at::zeros({config::kMetricCount}, logprobs_in.options().dtype(at::kFloat));
  float* metric = metrics.data_ptr<float>();
  if (advantages.has_groups) {
    metric[config::kMetricPhiMean] = static_cast<float>(advantages.phi_sum / std::max<int64_t>(segments, 1));
    metric[config::kMetricZeroStdFrac] = static_cast<float>(
        static_cast<double>(advantages.degenerate_groups) / std::max<int64_t>(advantages.groups, 1));
  }
  const bool counted = counts_batch_tokens(call.loss_agg_mode, call.loss_normalizer);
  if (segments == 0 || tokens_in == 0) {
    grad_logprobs.zero_();
    grad_entropy.zero_();
    return {at::zeros({}, options), grad_logprobs, grad_entropy, metrics,
            counted ? at::scalar_tensor(1.0, options) : at::empty({0}, options)};
  }

  const at::Tensor logprobs = compute_copy(logprobs_in, compute);
  const at::Tensor old_logprobs = compute_copy(old_logprobs_in, compute);
  const at::Tensor mask = response_mask.scalar_type() == at::kBool ? response_mask.contiguous()
                                                                   : at::ne(response_mask, 0).contiguous();
  const at::Tensor ref_logprobs = call.beta > 0 ? compute_copy(*ref_logprobs_in, compute) : at::Tensor();
  const at::Tensor importance =
      importance_weights_in.has_value() ? compute_copy(*importance_weights_in, compute) : at::Tensor();
  const at::Tensor entropy = entropy_in.has_value() ? compute_copy(*entropy_in, compute) : at::Tensor();
  const at::Tensor selected = selected_in.has_value() ? compute_copy(*selected_in, compute) : at::Tensor();
  const at::Tensor token_advantages =
      token_advantages_in.has_value() ? compute_copy(*token_advantages_in, compute) : at::Tensor();

  // Valid tokens per response, first: seq-mean-token-mean's weight needs them, and
  // token-mean's grad_scale their sum.
  // Read as bytes (0 or 1): loops over bool do not vectorise.
  const uint8_t* mask_data = reinterpret_cast<const uint8_t*>(mask.const_data_ptr<bool>());
  const int64_t grain = segment_grain(tokens_in, segments);
  std::vector<int64_t> lengths(segments);
  at::parallel_for(0, segments, grain, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      int64_t length = 0;
      for (int64_t t = offsets[row]; t < offsets[row + 1]; ++t) {
        length += mask_data[t];
      }
      lengths[row] = length;
    }
  });
  int64_t tokens = 0;
  for (int64_t length : lengths) {
    tokens += length;
  }
  const std::vector<double> agg_weight =
      agg_weights(lengths, call.loss_agg_mode, call.loss_normalizer, call.max_response_length);

  Problem<T> problem;
  problem.offsets = offsets.data();
  problem.logprobs = logprobs.const_data_ptr<T>();
  problem.old_logprobs = old_logprobs.const_data_ptr<T>();
  problem.mask = mask_data;
  problem.ref_logprobs = ref_logprobs.defined() ? ref_logprobs.const_data_ptr<T>() : nullptr;
  problem.importance = importance.defined() ? importance.const_data_ptr<T>() : nullptr;
  problem.entropy = entropy.defined() ? entropy.const_data_ptr<T>() : nullptr;
  problem.selected = selected.defined() ? selected.const_data_ptr<T>() : nullptr;
  problem.token_advantage = token_advantages.defined() ? token_advantages.const_data_ptr<T>() : nullptr;
  problem.response_advantage = token_advantages.defined() ? nullptr : advantages.advantage.data();
  problem.agg_weight = agg_weight.data();
  problem.lengths = lengths.data();
  problem.objective = call.objective;
  problem.ratio_level = call.ratio_level;
  problem.options = ObjectiveOptions<T>::from(call.epsilon_low, call.epsilon_high, call.objective_options);
  problem.beta = static_cast<T>(call.beta);
  problem.kl_estimator = call.kl_estimator;
  problem.entropy_coef = static_cast<T>(call.entropy_coef);
  problem.grad_logprobs = grad_logprobs.data_ptr<T>();
  problem.grad_entropy = entropy.defined() ? grad_entropy.data_ptr<T>() : nullptr;

  std::vector<ResponseSums> responses(segments);
  at::parallel_for(0, segments, grain, [&](int64_t first, int64_t last) {
    process_rows(problem, first, last, responses.data());
  });
  ResponseSums total;
  for (const ResponseSums& sums : responses) {
    total.add(sums);
  }

  const double ratio_count = std::max(total.ratio_count, 1.0);
  const double token_count = static_cast<double>(std::max<int64_t>(tokens, 1));
  metric[config::kMetricClipFracLow] = static_cast<float>(total.clipped_low / ratio_count);
  metric[config::kMetricClipFracHigh] = static_cast<float>(total.clipped_high / ratio_count);
  metric[config::kMetricRatioMean] = static_cast<float>(total.ratio / ratio_count);
  metric[config::kMetricApproxKl] = static_cast<float>(total.approx_kl / token_count);
  metric[config::kMetricRefKl] = call.beta > 0 ? static_cast<float>(total.ref_kl / token_count) : 0.0f;
  metric[config::kMetricEntropyMean] = entropy.defined() ? static_cast<float>(total.entropy / token_count) : 0.0f;
  if (counted) {
    const double grad_scale = 1.0 / token_count;
    return {at::scalar_tensor(total.loss * grad_scale, options), grad_logprobs, grad_entropy, metrics,
            at::scalar_tensor(grad_scale, options)};
  }
  return {at::scalar_tensor(total.loss, options), grad_logprobs, grad_entropy, metrics, at::empty({0}, options)};
}

void check_same_shape(const char* name, const at::Tensor& tensor, const at::Tensor& logprobs) {
  TORCH_CHECK(tensor.sizes() == logprobs.sizes(), "hadw_cpp::surrogate_loss: ", name, " must have the shape of ",
              "logprobs ", logprobs.sizes(), ", got ", tensor.sizes());
}

// The segment offsets as int64 on the host, checked: the token loops index with them.
std::vector<int64_t> checked_offsets(const at::Tensor& cu_seqlens, int64_t tokens) {
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1 &&
                  (cu_seqlens.scalar_type() == at::kLong || cu_seqlens.scalar_type() == at::kInt),
              "hadw_cpp::surrogate_loss: cu_seqlens must be int32 or int64 [S+1], got ", cu_seqlens.scalar_type(),
              " ", cu_seqlens.sizes());
  const at::Tensor values = cu_seqlens.to(at::kLong).contiguous();
  const int64_t* data = values.const_data_ptr<int64_t>();
  std::vector<int64_t> offsets(data, data + values.numel());
  TORCH_CHECK(offsets.front() == 0 && offsets.back() == tokens, "hadw_cpp::surrogate_loss: cu_seqlens must start "
              "at 0 and end at N = ", tokens, ", got ", offsets.front(), " and ", offsets.back());
  for (size_t i = 1; i < offsets.size(); ++i) {
    TORCH_CHECK(offsets[i] >= offsets[i - 1], "hadw_cpp::surrogate_loss: cu_seqlens decreases at ", i);
  }
  return offsets;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> surrogate_loss_cpu(
    const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& response_mask,
    const at::Tensor& cu_seqlens, const std::optional<at::Tensor>& rewards,
    const std::optional<at::Tensor>& advantages, const std::optional<at::Tensor>& response_advantages,
    const std::optional<at::Tensor>& anchor, const std::optional<at::Tensor>& ref_logprobs,
    const std::optional<at::Tensor>& importance_weights, const std::optional<at::Tensor>& entropy,
    const std::optional<at::Tensor>& selected, const std::optional<at::Tensor>& batch_totals,
    const std::optional<at::Tensor>& prior, std::optional<int64_t> group_size, int64_t advantage_estimator,
    bool normalize_std, double std_eps,
    double lambda_scale, int64_t loss_agg_mode, int64_t ratio_level, int64_t objective, double epsilon_low,
    double epsilon_high, c10::ArrayRef<double> objective_options, double beta, int64_t kl_estimator,
    double entropy_coef,
    std::optional<double> loss_normalizer, std::optional<int64_t> max_response_length) {
  TORCH_CHECK(logprobs.dim() == 1, "hadw_cpp::surrogate_loss: logprobs must be [N], got ", logprobs.sizes());
  TORCH_CHECK(at::isFloatingType(logprobs.scalar_type()), "hadw_cpp::surrogate_loss: logprobs must be floating "
              "point, got ", logprobs.scalar_type());
  const std::vector<int64_t> offsets = checked_offsets(cu_seqlens, logprobs.size(0));
  const int64_t segments = static_cast<int64_t>(offsets.size()) - 1;
  check_same_shape("old_logprobs", old_logprobs, logprobs);
  check_same_shape("response_mask", response_mask, logprobs);
  TORCH_CHECK(rewards.has_value() + advantages.has_value() + response_advantages.has_value() == 1,
              "hadw_cpp::surrogate_loss: pass exactly one of rewards, advantages and response_advantages");
  if (rewards.has_value()) {
    TORCH_CHECK(rewards->dim() == 1 && rewards->size(0) == segments, "hadw_cpp::surrogate_loss: rewards must be "
                "[S] = [", segments, "], got ", rewards->sizes());
  } else if (response_advantages.has_value()) {
    TORCH_CHECK(response_advantages->dim() == 1 && response_advantages->size(0) == segments,
                "hadw_cpp::surrogate_loss: response_advantages must be [S] = [", segments, "], got ",
                response_advantages->sizes());
  } else {
    check_same_shape("advantages", *advantages, logprobs);
  }
  TORCH_CHECK(loss_agg_mode >= 0 && loss_agg_mode < config::kAggCount,
              "hadw_cpp::surrogate_loss: loss_agg_mode must index config.AGG_MODES, got ", loss_agg_mode);
  TORCH_CHECK(kl_estimator >= 0 && kl_estimator < config::kKlCount,
              "hadw_cpp::surrogate_loss: kl_estimator must index config.KL_ESTIMATORS, got ", kl_estimator);
  TORCH_CHECK(objective >= 0 && objective < config::kObjectiveCount,
              "hadw_cpp::surrogate_loss: objective must index config.OBJECTIVE_NAMES, got ", objective);
  check_objective_options("hadw_cpp::surrogate_loss", objective, objective_options);
  TORCH_CHECK(ratio_level >= 0 && ratio_level < config::kRatioLevelCount,
              "hadw_cpp::surrogate_loss: ratio_level must index config.RATIO_LEVELS, got ", ratio_level);
  TORCH_CHECK(config::kObjectiveTakesRatioLevel[objective][ratio_level], "hadw_cpp::surrogate_loss: objective ",
              objective, " does not take ratio_level ", ratio_level, " (config.OBJECTIVES)");
  if (beta > 0) {
    TORCH_CHECK(ref_logprobs.has_value(), "hadw_cpp::surrogate_loss: beta > 0 needs ref_logprobs");
    check_same_shape("ref_logprobs", *ref_logprobs, logprobs);
  }
  if (importance_weights.has_value()) {
    check_same_shape("importance_weights", *importance_weights, logprobs);
  }
  if (entropy.has_value()) {
    check_same_shape("entropy", *entropy, logprobs);
  }
  if (selected.has_value()) {
    check_same_shape("selected", *selected, logprobs);
  }

  // A_i per response: from rewards (with the group metrics), or the caller's; the
  // caller's advantages per token are read in the token loop. The caller's leave the
  // group metrics at 0.
  Advantages advantage_terms;
  if (response_advantages.has_value()) {
    // Each rounds to the compute type in the token loop, as a per-token copy would.
    advantage_terms.advantage = to_doubles(*response_advantages);
  } else if (rewards.has_value()) {
    TORCH_CHECK(group_size.has_value() && *group_size >= 2 && segments % *group_size == 0,
                "hadw_cpp::surrogate_loss: rewards need a group_size >= 2 that divides the segments (", segments,
                "), got ", group_size.has_value() ? std::to_string(*group_size) : std::string("None"));
    advantage_terms = group_advantages(*rewards, *group_size, advantage_estimator, normalize_std, std_eps, anchor,
                                       lambda_scale, batch_totals, prior);
  }
  const Options call{loss_agg_mode, ratio_level, objective, epsilon_low, epsilon_high, objective_options,
                     beta, kl_estimator, entropy_coef, loss_normalizer, max_response_length};
  const auto compute = at::promote_types(logprobs.scalar_type(), at::kFloat);
  if (compute == at::kDouble) {
    return surrogate_impl<double>(logprobs, old_logprobs, response_mask, offsets, ref_logprobs, importance_weights,
                                  entropy, selected, advantage_terms, advantages, compute, call);
  }
  return surrogate_impl<float>(logprobs, old_logprobs, response_mask, offsets, ref_logprobs, importance_weights,
                               entropy, selected, advantage_terms, advantages, compute, call);
}

}  // namespace hadw
