// CPU kernel of hadw::surrogate_loss (SPEC sections 2, 4 and 5): group advantages,
// HA-DW weights, the clipped surrogate of grpo / dapo / gspo / dr_grpo with KL(k3),
// dual clip, importance weights and an entropy bonus, in one pass over the tokens that
// writes the loss, its gradient and the metrics (in ops.METRIC_NAMES order).
//
// The loss is the end of the graph, so the gradient with respect to the log-probs (and
// the entropy) is formed here and autograd only scales it by the upstream scalar.
// Derivatives follow PyTorch's rules for the reference's ops, ties included:
// torch.maximum / torch.minimum split the gradient evenly between equal operands and
// torch.clamp passes it on the closed interval.
//
// Per-token math runs in the accumulate type (fp32, fp64 for fp64 inputs); every sum
// (loss, metrics, a GSPO response's log-ratio) runs in double. Responses are processed
// in parallel and their sums are added in response order, so the result does not depend
// on the thread count.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/promote_types.h>
#include <ATen/ops/scalar_tensor.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace hadw {
namespace {

constexpr double kStdEpsilon = 1e-6;      // advantage.STD_EPS
constexpr double kLogRatioClamp = 20.0;   // config.LOG_RATIO_CLAMP
constexpr int64_t kMetricCount = 8;       // ops.METRIC_NAMES

enum class LossType { kGrpo, kDapo, kGspo, kDrGrpo };

LossType parse_loss_type(std::string_view name) {
  if (name == "grpo") return LossType::kGrpo;
  if (name == "dapo") return LossType::kDapo;
  if (name == "gspo") return LossType::kGspo;
  if (name == "dr_grpo") return LossType::kDrGrpo;
  TORCH_CHECK(false, "hadw::surrogate_loss: unknown loss_type '", std::string(name),
              "'; expected grpo, dapo, gspo or dr_grpo");
}

double sign(double value) { return static_cast<double>((value > 0) - (value < 0)); }

// A_i = A_hat_i * Phi_i for every response, in double.
struct Advantages {
  std::vector<double> advantage;
  std::vector<double> phi;
  int64_t groups = 0;
  int64_t degenerate_groups = 0;
};

Advantages group_advantages(const at::Tensor& rewards, int64_t group_size, bool normalize_std,
                            const std::optional<at::Tensor>& anchor, double lambda_scale) {
  // The reference works on rewards promoted to at least fp32 (bf16 would round k/G) and
  // rounds the anchor to that dtype; double arithmetic from there is as precise or better.
  const auto reward_type = at::promote_types(rewards.scalar_type(), at::kFloat);
  const at::Tensor values = rewards.detach().to(reward_type).to(at::kDouble).contiguous();
  std::optional<double> belief;
  if (anchor.has_value()) {
    TORCH_CHECK(anchor->numel() == 1, "hadw::surrogate_loss: anchor must be a scalar, got shape ", anchor->sizes());
    belief = anchor->detach().to(reward_type).item<double>();
  }
  const int64_t batch = values.size(0);
  const double* reward = values.const_data_ptr<double>();
  Advantages result;
  result.advantage.resize(batch);
  result.phi.resize(batch);
  result.groups = batch / group_size;
  for (int64_t first = 0; first < batch; first += group_size) {
    const double* group = reward + first;
    double total = 0;
    double lowest = group[0];
    double highest = group[0];
    for (int64_t i = 0; i < group_size; ++i) {
      total += group[i];
      lowest = std::min(lowest, group[i]);
      highest = std::max(highest, group[i]);
    }
    const double mean = total / group_size;
    double squares = 0;
    for (int64_t i = 0; i < group_size; ++i) {
      squares += (group[i] - mean) * (group[i] - mean);
    }
    const double std_dev = std::sqrt(squares / (group_size - 1));
    // min == max, not std == 0: the mean of equal non-dyadic rewards need not equal them.
    const bool degenerate = lowest == highest;
    result.degenerate_groups += degenerate;
    for (int64_t i = 0; i < group_size; ++i) {
      const double centred = group[i] - mean;
      double advantage_hat = normalize_std ? centred / (std_dev + kStdEpsilon) : centred;
      double phi = 1.0;
      if (belief.has_value()) {
        const double difficulty = mean - *belief;
        const double advantage_sign = degenerate ? 0.0 : sign(centred);
        phi = lambda_scale * std::exp(-advantage_sign * sign(difficulty) * std::abs(difficulty));
      }
      if (degenerate) {
        advantage_hat = 0.0;
      }
      result.advantage[first + i] = advantage_hat * phi;
      result.phi[first + i] = phi;
    }
  }
  return result;
}

template <typename T>
struct ClipRange {
  T lower;  // 1 - epsilon_low
  T upper;  // 1 + epsilon_high
  std::optional<T> dual_clip;
};

// loss = -min(rho A, clip(rho) A), bounded by -c A for A < 0 under dual clip, and its
// derivative with respect to rho.
template <typename T>
struct ClippedTerm {
  T loss;
  T slope;
};

template <typename T>
ClippedTerm<T> clipped_objective(T ratio, T advantage, const ClipRange<T>& clip) {
  const T unclipped = -ratio * advantage;
  const T clipped = -std::min(std::max(ratio, clip.lower), clip.upper) * advantage;
  const T unclipped_slope = -advantage;
  const T clipped_slope = (ratio >= clip.lower && ratio <= clip.upper) ? -advantage : T(0);
  ClippedTerm<T> term;
  if (unclipped > clipped) {
    term = {unclipped, unclipped_slope};
  } else if (unclipped < clipped) {
    term = {clipped, clipped_slope};
  } else {
    term = {unclipped, (unclipped_slope + clipped_slope) / 2};
  }
  if (clip.dual_clip.has_value() && advantage < 0) {
    const T bound = -*clip.dual_clip * advantage;
    if (term.loss > bound) {
      term = {bound, T(0)};
    } else if (term.loss == bound) {
      term.slope /= 2;
    }
  }
  return term;
}

// Inputs of the token loop, all [B, T] contiguous in the accumulate type unless noted.
template <typename T>
struct Problem {
  LossType loss_type;
  int64_t width;
  const T* logprobs;
  const T* old_logprobs;
  const bool* mask;
  const T* ref_logprobs;  // null unless beta > 0
  const T* weights;       // importance weights [B, T] or [B], or null
  bool per_token_weights;
  const T* entropy;       // or null
  const double* advantage;  // [B]
  const int64_t* lengths;   // [B] valid tokens per response
  ClipRange<T> clip;
  T beta;
  T entropy_coef;
  double responses;   // loss_normalizer, or B: the denominator of all but dapo
  double tokens;      // loss_normalizer, or the batch's valid tokens (at least 1): dapo's
  double max_length;  // dr_grpo's L_max
  T* grad_logprobs;
  T* grad_entropy;    // or null
};

// What one response adds to the loss and to the metric sums.
struct ResponseSums {
  double loss = 0;
  double ratio_count = 0;  // tokens (per-token ratios) or 1 (gspo's response ratio)
  double clipped_low = 0;
  double clipped_high = 0;
  double ratio = 0;
  double approx_kl = 0;
  double ref_kl = 0;
  double entropy = 0;
};

// The weight of one of this response's valid tokens in the loss type's aggregate.
template <typename T>
double token_scale(const Problem<T>& problem, int64_t row) {
  switch (problem.loss_type) {
    case LossType::kDapo:
      return 1.0 / problem.tokens;
    case LossType::kDrGrpo:
      return 1.0 / problem.max_length / problem.responses;
    default:
      return 1.0 / std::max<int64_t>(problem.lengths[row], 1) / problem.responses;
  }
}

template <typename T>
void count_ratio(ResponseSums& sums, T ratio, T advantage, const ClipRange<T>& clip) {
  sums.ratio_count += 1;
  sums.ratio += ratio;
  sums.clipped_low += (ratio < clip.lower && advantage < 0);
  sums.clipped_high += (ratio > clip.upper && advantage > 0);
}

template <typename T>
ResponseSums process_response(const Problem<T>& problem, int64_t row) {
  const int64_t offset = row * problem.width;
  const T* logprobs = problem.logprobs + offset;
  const T* old_logprobs = problem.old_logprobs + offset;
  const bool* mask = problem.mask + offset;
  T* grad = problem.grad_logprobs + offset;
  T* grad_entropy = problem.grad_entropy == nullptr ? nullptr : problem.grad_entropy + offset;
  const int64_t length = problem.lengths[row];
  const T scale = static_cast<T>(token_scale(problem, row));
  const T advantage = static_cast<T>(problem.advantage[row]);
  const T limit = static_cast<T>(kLogRatioClamp);
  const bool sequence_level = problem.loss_type == LossType::kGspo;
  ResponseSums sums;

  // gspo: one ratio for the response, exp of its tokens' mean log-ratio; each token's
  // log-prob reaches the loss through it with weight 1 / length.
  T sequence_grad = 0;
  if (sequence_level && length > 0) {
    double log_ratio_sum = 0;
    for (int64_t t = 0; t < problem.width; ++t) {
      if (mask[t]) {
        log_ratio_sum += logprobs[t] - old_logprobs[t];
      }
    }
    const T mean_log_ratio = static_cast<T>(log_ratio_sum / length);
    const T ratio = std::exp(std::min(std::max(mean_log_ratio, -limit), limit));
    const ClippedTerm<T> term = clipped_objective(ratio, advantage, problem.clip);
    const T weight = problem.weights == nullptr ? T(1) : problem.weights[row];
    sums.loss += static_cast<double>(term.loss * weight) / problem.responses;
    if (mean_log_ratio >= -limit && mean_log_ratio <= limit) {
      sequence_grad = static_cast<T>(term.slope * ratio * weight / length / problem.responses);
    }
    count_ratio(sums, ratio, advantage, problem.clip);
  }

  double policy = 0;
  double ref_kl = 0;
  double entropy = 0;
  for (int64_t t = 0; t < problem.width; ++t) {
    // Masked positions may hold inf or NaN: they are never read into arithmetic.
    if (!mask[t]) {
      grad[t] = 0;
      if (grad_entropy != nullptr) {
        grad_entropy[t] = 0;
      }
      continue;
    }
    const T log_ratio = logprobs[t] - old_logprobs[t];
    const T clamped = std::min(std::max(log_ratio, -limit), limit);
    sums.approx_kl += std::expm1(clamped) - clamped;
    T token_grad = 0;  // d(aggregated per-token terms) / d logp, before the token's scale
    if (!sequence_level) {
      const T ratio = std::exp(clamped);
      const ClippedTerm<T> term = clipped_objective(ratio, advantage, problem.clip);
      T weight = 1;
      if (problem.weights != nullptr) {
        weight = problem.per_token_weights ? problem.weights[offset + t] : problem.weights[row];
      }
      policy += term.loss * weight;
      if (log_ratio >= -limit && log_ratio <= limit) {
        token_grad = term.slope * ratio * weight;
      }
      count_ratio(sums, ratio, advantage, problem.clip);
    }
    if (problem.ref_logprobs != nullptr) {
      // k3 = exp(ref - logp) - (ref - logp) - 1
      const T delta = problem.ref_logprobs[offset + t] - logprobs[t];
      const T exp_delta = std::exp(delta);
      ref_kl += exp_delta - delta - T(1);
      token_grad += problem.beta * (T(1) - exp_delta);
    }
    if (problem.entropy != nullptr) {
      entropy += problem.entropy[offset + t];
    }
    grad[t] = token_grad * scale + sequence_grad;
    if (grad_entropy != nullptr) {
      grad_entropy[t] = -problem.entropy_coef * scale;
    }
  }
  double token_terms = policy + static_cast<double>(problem.beta) * ref_kl;
  if (problem.entropy_coef > 0) {
    token_terms -= static_cast<double>(problem.entropy_coef) * entropy;
  }
  sums.loss += token_terms * static_cast<double>(scale);
  sums.ref_kl = ref_kl;
  sums.entropy = entropy;
  return sums;
}

at::Tensor to_accumulate(const at::Tensor& tensor, at::ScalarType accumulate) {
  return tensor.detach().to(accumulate).contiguous();
}

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> surrogate_impl(
    const at::Tensor& logprobs_in, const at::Tensor& old_logprobs_in, const at::Tensor& response_mask,
    const std::optional<at::Tensor>& ref_logprobs_in, const std::optional<at::Tensor>& importance_weights_in,
    const std::optional<at::Tensor>& entropy_in, const Advantages& advantages, LossType loss_type,
    at::ScalarType accumulate, double epsilon_low, double epsilon_high, double beta, std::optional<double> dual_clip,
    double entropy_coef, std::optional<double> loss_normalizer, std::optional<int64_t> max_response_length) {
  const int64_t batch = logprobs_in.size(0);
  const int64_t width = logprobs_in.size(1);
  const auto options = logprobs_in.options().dtype(accumulate);
  const at::Tensor logprobs = to_accumulate(logprobs_in, accumulate);
  const at::Tensor old_logprobs = to_accumulate(old_logprobs_in, accumulate);
  const at::Tensor mask = response_mask.detach().to(at::kBool).contiguous();
  const at::Tensor lengths = mask.sum(1, false, at::kLong);
  const int64_t total_tokens = lengths.sum().item<int64_t>();
  at::Tensor ref_logprobs;
  if (beta > 0) {
    TORCH_CHECK(ref_logprobs_in.has_value(), "hadw::surrogate_loss: beta > 0 needs ref_logprobs");
    ref_logprobs = to_accumulate(*ref_logprobs_in, accumulate);
  }
  at::Tensor weights;
  if (importance_weights_in.has_value()) {
    weights = to_accumulate(*importance_weights_in, accumulate);
  }
  at::Tensor entropy;
  at::Tensor grad_entropy = at::empty({0}, options);
  if (entropy_in.has_value()) {
    entropy = to_accumulate(*entropy_in, accumulate);
    grad_entropy = at::empty(entropy_in->sizes(), options);
  }
  at::Tensor grad_logprobs = at::empty({batch, width}, options);

  Problem<T> problem;
  problem.loss_type = loss_type;
  problem.width = width;
  problem.logprobs = logprobs.const_data_ptr<T>();
  problem.old_logprobs = old_logprobs.const_data_ptr<T>();
  problem.mask = mask.const_data_ptr<bool>();
  problem.ref_logprobs = ref_logprobs.defined() ? ref_logprobs.const_data_ptr<T>() : nullptr;
  problem.weights = weights.defined() ? weights.const_data_ptr<T>() : nullptr;
  problem.per_token_weights = weights.defined() && weights.dim() == 2;
  problem.entropy = entropy.defined() ? entropy.const_data_ptr<T>() : nullptr;
  problem.advantage = advantages.advantage.data();
  problem.lengths = lengths.const_data_ptr<int64_t>();
  // Thresholds in the accumulate type, as the reference's tensor-scalar ops round them.
  problem.clip.lower = static_cast<T>(1.0 - epsilon_low);
  problem.clip.upper = static_cast<T>(1.0 + epsilon_high);
  if (dual_clip.has_value()) {
    problem.clip.dual_clip = static_cast<T>(*dual_clip);
  }
  problem.beta = static_cast<T>(beta);
  problem.entropy_coef = static_cast<T>(entropy_coef);
  problem.responses = loss_normalizer.value_or(static_cast<double>(batch));
  problem.tokens = loss_normalizer.value_or(static_cast<double>(std::max<int64_t>(total_tokens, 1)));
  problem.max_length = static_cast<double>(max_response_length.value_or(width));
  problem.grad_logprobs = grad_logprobs.data_ptr<T>();
  problem.grad_entropy = entropy.defined() ? grad_entropy.data_ptr<T>() : nullptr;

  std::vector<ResponseSums> responses(batch);
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(width, 1));
  at::parallel_for(0, batch, grain, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      responses[row] = process_response(problem, row);
    }
  });

  ResponseSums total;
  for (const ResponseSums& sums : responses) {
    total.loss += sums.loss;
    total.ratio_count += sums.ratio_count;
    total.clipped_low += sums.clipped_low;
    total.clipped_high += sums.clipped_high;
    total.ratio += sums.ratio;
    total.approx_kl += sums.approx_kl;
    total.ref_kl += sums.ref_kl;
    total.entropy += sums.entropy;
  }
  const double ratio_count = std::max(total.ratio_count, 1.0);
  const double token_count = static_cast<double>(std::max<int64_t>(total_tokens, 1));
  double phi_sum = 0;
  for (double phi : advantages.phi) {
    phi_sum += phi;
  }
  at::Tensor metrics = at::empty({kMetricCount}, logprobs_in.options().dtype(at::kFloat));
  float* metric = metrics.data_ptr<float>();
  metric[0] = static_cast<float>(total.clipped_low / ratio_count);
  metric[1] = static_cast<float>(total.clipped_high / ratio_count);
  metric[2] = static_cast<float>(total.ratio / ratio_count);
  metric[3] = static_cast<float>(total.approx_kl / token_count);
  metric[4] = static_cast<float>(phi_sum / std::max<int64_t>(batch, 1));
  metric[5] = advantages.groups > 0
                  ? static_cast<float>(static_cast<double>(advantages.degenerate_groups) / advantages.groups)
                  : 0.0f;
  metric[6] = beta > 0 ? static_cast<float>(total.ref_kl / token_count) : 0.0f;
  metric[7] = entropy.defined() ? static_cast<float>(total.entropy / token_count) : 0.0f;
  at::Tensor loss = at::scalar_tensor(total.loss, options);
  return {loss, grad_logprobs, grad_entropy, metrics};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> surrogate_loss_cpu(
    const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& rewards,
    const at::Tensor& response_mask, const std::optional<at::Tensor>& anchor,
    const std::optional<at::Tensor>& ref_logprobs, const std::optional<at::Tensor>& importance_weights,
    const std::optional<at::Tensor>& entropy, int64_t group_size, std::string_view loss_type, double epsilon_low,
    double epsilon_high, double lambda_scale, double beta, std::optional<double> dual_clip, double entropy_coef,
    std::optional<double> loss_normalizer, std::optional<int64_t> max_response_length) {
  const LossType type = parse_loss_type(loss_type);
  TORCH_CHECK(logprobs.dim() == 2, "hadw::surrogate_loss: logprobs must be [B, T], got ", logprobs.sizes());
  const int64_t batch = logprobs.size(0);
  TORCH_CHECK(old_logprobs.sizes() == logprobs.sizes() && response_mask.sizes() == logprobs.sizes(),
              "hadw::surrogate_loss: logprobs ", logprobs.sizes(), ", old_logprobs ", old_logprobs.sizes(),
              " and response_mask ", response_mask.sizes(), " must have one shape");
  TORCH_CHECK(rewards.dim() == 1 && rewards.size(0) == batch, "hadw::surrogate_loss: rewards must be [B] = [", batch,
              "], got ", rewards.sizes());
  TORCH_CHECK(group_size >= 2 && batch % group_size == 0, "hadw::surrogate_loss: a batch of ", batch,
              " responses does not split into groups of ", group_size);
  if (ref_logprobs.has_value()) {
    TORCH_CHECK(ref_logprobs->sizes() == logprobs.sizes(), "hadw::surrogate_loss: ref_logprobs must be ",
                logprobs.sizes(), ", got ", ref_logprobs->sizes());
  }
  if (importance_weights.has_value()) {
    const bool per_response = importance_weights->dim() == 1 && importance_weights->size(0) == batch;
    const bool per_token = importance_weights->sizes() == logprobs.sizes();
    TORCH_CHECK(per_response || (per_token && type != LossType::kGspo),
                "hadw::surrogate_loss: importance_weights must be [B]", type == LossType::kGspo ? "" : " or [B, T]",
                " for loss_type ", std::string(loss_type), ", got ", importance_weights->sizes());
  }
  if (entropy.has_value()) {
    TORCH_CHECK(entropy->sizes() == logprobs.sizes(), "hadw::surrogate_loss: entropy must be ", logprobs.sizes(),
                ", got ", entropy->sizes());
  }
  const auto dtype = logprobs.scalar_type();
  TORCH_CHECK(at::isFloatingType(dtype), "hadw::surrogate_loss: logprobs must be floating point, got ", dtype);
  const auto accumulate = dtype == at::kDouble ? at::kDouble : at::kFloat;

  const Advantages advantages =
      group_advantages(rewards, group_size, type != LossType::kDrGrpo, anchor, lambda_scale);
  return accumulate == at::kDouble
                     ? surrogate_impl<double>(logprobs, old_logprobs, response_mask, ref_logprobs, importance_weights,
                                              entropy, advantages, type, accumulate, epsilon_low, epsilon_high, beta,
                                              dual_clip, entropy_coef, loss_normalizer, max_response_length)
                     : surrogate_impl<float>(logprobs, old_logprobs, response_mask, ref_logprobs, importance_weights,
                                             entropy, advantages, type, accumulate, epsilon_low, epsilon_high, beta,
                                             dual_clip, entropy_coef, loss_normalizer, max_response_length);
}

}  // namespace hadw
