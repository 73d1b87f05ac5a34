// The CPU kernels of the hadw:: ops. Their schemas (argument names, order, types) are
// defined once, in Python (hadw_kernels/ops.py); these signatures follow them.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>
#include <tuple>

namespace hadw {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> surrogate_loss_cpu(
    const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& rewards,
    const at::Tensor& response_mask, const std::optional<at::Tensor>& anchor,
    const std::optional<at::Tensor>& ref_logprobs, const std::optional<at::Tensor>& importance_weights,
    const std::optional<at::Tensor>& entropy, int64_t group_size, std::string_view loss_type, double epsilon_low,
    double epsilon_high, double lambda_scale, double beta, std::optional<double> dual_clip, double entropy_coef,
    std::optional<double> loss_normalizer, std::optional<int64_t> max_response_length);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_logprob_forward_cpu(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& labels, double temperature, int64_t ignore_index, bool with_entropy);

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_logprob_backward_cpu(
    const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
    const at::Tensor& weight, const std::optional<at::Tensor>& bias, const at::Tensor& labels, const at::Tensor& lse,
    const at::Tensor& mean_logit, double temperature, int64_t ignore_index);

}  // namespace hadw
