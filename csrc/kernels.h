// The CPU kernels of the hadw_cpp:: ops. Their schemas (argument names, order, types) are
// defined once, in Python (hadw_kernels/ops/schemas.py: SIGNATURES without the routing
// argument); these signatures follow them, and the dispatcher checks that they do when
// the module registers them.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace hadw {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> surrogate_loss_cpu(
    const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& response_mask,
    const std::optional<at::Tensor>& rewards, const std::optional<at::Tensor>& advantages,
    const std::optional<at::Tensor>& anchor, const std::optional<at::Tensor>& ref_logprobs,
    const std::optional<at::Tensor>& importance_weights, const std::optional<at::Tensor>& entropy,
    std::optional<int64_t> group_size, bool normalize_std, double std_eps, double lambda_scale, int64_t loss_agg_mode,
    bool sequence_level, double epsilon_low, double epsilon_high, std::optional<double> dual_clip, double beta,
    int64_t kl_estimator, double entropy_coef, std::optional<double> loss_normalizer,
    std::optional<int64_t> max_response_length);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_logprob_forward_cpu(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& labels, double temperature, int64_t ignore_index, bool with_entropy);

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_logprob_backward_cpu(
    const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
    const at::Tensor& weight, const std::optional<at::Tensor>& bias, const at::Tensor& labels, const at::Tensor& lse,
    const at::Tensor& mean_logit, double temperature, int64_t ignore_index);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_surrogate_forward_cpu(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& labels, const std::optional<at::Tensor>& old_logprobs, const at::Tensor& advantages,
    const at::Tensor& agg_weights, const std::optional<at::Tensor>& ref_logprobs,
    const std::optional<at::Tensor>& importance_weights, double temperature, int64_t ignore_index,
    double epsilon_low, double epsilon_high, std::optional<double> dual_clip, double beta, int64_t kl_estimator,
    double entropy_coef, bool with_entropy, int64_t block_rows);

// "avx512" or "portable": which loops the softmax row sums run on this CPU (tile_math.h).
const char* row_kernels();

}  // namespace hadw
