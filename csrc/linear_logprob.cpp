// CPU kernels of hadw::linear_logprob_forward / hadw::linear_logprob_backward
// (SPEC section 6): log-probs of the labels, and the entropy, of softmax(h W^T / T),
// and their gradients, without an [N, V] logits tensor.
//
// Work is cut into blocks of rows (hidden states); inside a block the threads share the
// vocabulary, tile by tile (see Slabs). A BLAS GEMM writes a tile of raw products into
// the thread's own [rows, tile] buffer, and the softmax statistics (forward) or the
// logits gradient (backward) are formed in place while it is in the core's cache.
// Backward then feeds the tile to two GEMMs: the tile's grad_weight rows (no other
// thread writes them) and a partial grad_hidden of the block, summed after the block.
// Only rows that take part enter a block: an ignored label, or (backward) a zero
// upstream gradient, as on padding, costs no GEMM.
//
// Backward recomputes the logits tile: the log-probs feed an arbitrary surrogate whose
// gradient is known only after every log-prob is (see backends/torch_backend.py).

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "tile_math.h"

namespace hadw {
namespace {

// Rows of hidden states per block: large enough that the grad_weight GEMM has a deep
// reduction (K = rows) and W is streamed few times, small enough that a block of
// hidden states (rows x H fp32) stays near the cores.
constexpr int64_t kRowBlock = 512;
// Vocabulary columns per tile: a 512 x 256 fp32 tile is 512 KiB, half a core's L2 here.
constexpr int64_t kVocabTile = 256;

// The tile functions for each accumulate type. fp32 is the hot path, compiled once per
// instruction set (HADW_VECTOR_CLONES); fp64 serves exact comparisons.
HADW_VECTOR_CLONES void fold_tile_of(float* tile, int64_t rows, int64_t cols, float scale, const float* scaled_bias,
                                     SoftmaxState<float>* states, const int64_t* labels, int64_t first_column,
                                     float* label_logits) {
  fold_tile(tile, rows, cols, scale, scaled_bias, states, labels, first_column, label_logits);
}

void fold_tile_of(double* tile, int64_t rows, int64_t cols, double scale, const double* scaled_bias,
                  SoftmaxState<double>* states, const int64_t* labels, int64_t first_column, double* label_logits) {
  fold_tile(tile, rows, cols, scale, scaled_bias, states, labels, first_column, label_logits);
}

HADW_VECTOR_CLONES void gradient_tile_of(float* tile, int64_t rows, int64_t cols, float scale,
                                         const float* scaled_bias, const float* lse, const float* mean_logit,
                                         const float* grad_logprobs, const float* grad_entropy, const int64_t* labels,
                                         int64_t first_column, float* bias_gradient) {
  gradient_tile(tile, rows, cols, scale, scaled_bias, lse, mean_logit, grad_logprobs, grad_entropy, labels,
                first_column, bias_gradient);
}

void gradient_tile_of(double* tile, int64_t rows, int64_t cols, double scale, const double* scaled_bias,
                      const double* lse, const double* mean_logit, const double* grad_logprobs,
                      const double* grad_entropy, const int64_t* labels, int64_t first_column,
                      double* bias_gradient) {
  gradient_tile(tile, rows, cols, scale, scaled_bias, lse, mean_logit, grad_logprobs, grad_entropy, labels,
                first_column, bias_gradient);
}

at::ScalarType accumulate_type(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

// The vocabulary tiles are split into slabs of consecutive tiles, more slabs than
// threads, and idle threads claim the next slab: a thread slowed by other work on the
// machine delays its block by one slab, not by a fixed share. Each slab keeps its own
// partial results (softmax statistics, grad_hidden rows), combined in slab order, so
// the results do not depend on which thread ran which slab. The grad_hidden partials
// take slabs x rows x H floats: 8 MiB at 2 threads, H = 512.
constexpr int64_t kSlabsPerThread = 4;

struct Slabs {
  int64_t tiles;
  int64_t count;

  int64_t first_tile(int64_t slab) const { return slab * tiles / count; }
  int64_t end_tile(int64_t slab) const { return (slab + 1) * tiles / count; }
};

// Runs work(worker, slab) for every slab on up to `workers` threads; `worker` indexes
// the calling thread's own buffers.
template <typename Work>
void for_each_slab(int64_t workers, const Slabs& slabs, const Work& work) {
  std::atomic<int64_t> next_slab{0};
  at::parallel_for(0, workers, 1, [&](int64_t first_worker, int64_t end_worker) {
    for (int64_t worker = first_worker; worker < end_worker; ++worker) {
      for (int64_t slab = next_slab++; slab < slabs.count; slab = next_slab++) {
        work(worker, slab);
      }
    }
  });
}

// The LM head in the accumulate type, one tile at a time. An fp32/fp64 head is used in
// place; a bf16/fp16 head is widened tile by tile into the worker's own buffer (exactly:
// every bf16/fp16 value is an fp32 value), so the GEMM accumulates in fp32 and the
// logits are never rounded to 16 bits.
class WeightTiles {
 public:
  WeightTiles(const at::Tensor& weight, at::ScalarType accumulate, int64_t workers)
      : weight_(weight), widen_(weight.scalar_type() != accumulate) {
    if (widen_) {
      for (int64_t worker = 0; worker < workers; ++worker) {
        buffers_.push_back(at::empty({kVocabTile, weight.size(1)}, weight.options().dtype(accumulate)));
      }
    }
  }

  at::Tensor tile(int64_t worker, int64_t first_column, int64_t cols) const {
    if (!widen_) {
      return weight_.narrow(0, first_column, cols);
    }
    at::Tensor buffer = buffers_[worker].narrow(0, 0, cols);
    const int64_t offset = first_column * weight_.size(1);
    const int64_t count = cols * weight_.size(1);
    float* out = buffer.data_ptr<float>();
    if (weight_.scalar_type() == at::kBFloat16) {
      widen(weight_.const_data_ptr<c10::BFloat16>() + offset, out, count);
    } else {
      widen(weight_.const_data_ptr<c10::Half>() + offset, out, count);
    }
    return buffer;
  }

 private:
  template <typename Narrow>
  static void widen(const Narrow* in, float* out, int64_t count) {
    for (int64_t i = 0; i < count; ++i) {
      out[i] = static_cast<float>(in[i]);
    }
  }

  at::Tensor weight_;
  bool widen_;
  std::vector<at::Tensor> buffers_;
};

struct LinearInputs {
  at::Tensor hidden;       // [N, H] input dtype
  at::Tensor weight;       // [V, H] contiguous, input dtype
  at::Tensor scaled_bias;  // [V] accumulate dtype, bias / temperature, or undefined
  at::Tensor labels;       // [N] int64
  at::ScalarType accumulate;
  int64_t workers;
  Slabs slabs;
};

LinearInputs prepare_inputs(const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            const at::Tensor& labels, double temperature, int64_t ignore_index) {
  TORCH_CHECK(hidden.dim() == 2, "hadw::linear_logprob: hidden must be [N, H], got ", hidden.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == hidden.size(1),
              "hadw::linear_logprob: weight must be [V, H] with H = ", hidden.size(1), ", got ", weight.sizes());
  TORCH_CHECK(weight.size(0) > 0, "hadw::linear_logprob: the vocabulary is empty");
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type(), "hadw::linear_logprob: hidden (", hidden.scalar_type(),
              ") and weight (", weight.scalar_type(), ") must share a dtype");
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf,
              "hadw::linear_logprob: unsupported dtype ", dtype);
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == hidden.size(0),
              "hadw::linear_logprob: labels must be [N] = [", hidden.size(0), "], got ", labels.sizes());
  TORCH_CHECK(temperature > 0, "hadw::linear_logprob: temperature must be positive, got ", temperature);
  LinearInputs inputs;
  // Kernels see no autograd: worker threads do not inherit the caller's dispatch state.
  inputs.hidden = hidden.detach();
  inputs.weight = weight.detach().contiguous();
  inputs.accumulate = accumulate_type(dtype);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0),
                "hadw::linear_logprob: bias must be [V] = [", weight.size(0), "], got ", bias->sizes());
    inputs.scaled_bias = (bias->detach().to(inputs.accumulate) / temperature).contiguous();
  }
  inputs.labels = labels.detach().to(at::kLong).contiguous();
  // Labels outside the vocabulary would pick no logit and give a wrong log-prob silently.
  const int64_t vocab = weight.size(0);
  const int64_t* label = inputs.labels.const_data_ptr<int64_t>();
  for (int64_t row = 0; row < inputs.labels.size(0); ++row) {
    TORCH_CHECK(label[row] == ignore_index || (label[row] >= 0 && label[row] < vocab),
                "hadw::linear_logprob: label ", label[row], " at row ", row, " is outside [0, ", vocab,
                ") and is not ignore_index=", ignore_index);
  }
  const int64_t tiles = (vocab + kVocabTile - 1) / kVocabTile;
  inputs.workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tiles));
  inputs.slabs = {tiles, std::min(tiles, inputs.workers * kSlabsPerThread)};
  return inputs;
}

// Row blocks over the rows that take part (a label that is not ignore_index, and in
// backward a non-zero upstream gradient): the others need no logits at all, so
// padding costs no GEMM.
struct RowBlocks {
  at::Tensor rows;  // [active] int64, indices of the rows that take part
  int64_t block_rows;

  RowBlocks(const at::Tensor& active, int64_t max_block_rows) {
    rows = active.nonzero().flatten();
    block_rows = std::min(max_block_rows, std::max<int64_t>(rows.size(0), 1));
  }
  int64_t count() const { return rows.size(0); }
  at::Tensor block(int64_t first) const { return rows.narrow(0, first, std::min(block_rows, count() - first)); }
};

template <typename acc_t>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_impl(const LinearInputs& in, double temperature,
                                                                         int64_t ignore_index) {
  const int64_t num_rows = in.hidden.size(0);
  const int64_t vocab = in.weight.size(0);
  const auto options = in.hidden.options().dtype(in.accumulate);
  // Ignored rows: log-prob and entropy 0; their lse and mean logit are never used.
  at::Tensor logprobs = at::zeros({num_rows}, options);
  at::Tensor entropy = at::zeros({num_rows}, options);
  at::Tensor lse = at::zeros({num_rows}, options);
  at::Tensor mean_logit = at::zeros({num_rows}, options);

  const RowBlocks blocks(in.labels != ignore_index, kRowBlock);
  const acc_t scale = static_cast<acc_t>(1.0 / temperature);
  const acc_t* scaled_bias = in.scaled_bias.defined() ? in.scaled_bias.const_data_ptr<acc_t>() : nullptr;
  WeightTiles weight_tiles(in.weight, in.accumulate, in.workers);
  std::vector<at::Tensor> logits_buffers;
  for (int64_t worker = 0; worker < in.workers; ++worker) {
    logits_buffers.push_back(at::empty({blocks.block_rows * kVocabTile}, options));
  }
  std::vector<SoftmaxState<acc_t>> states(in.slabs.count * blocks.block_rows);
  std::vector<acc_t> label_logits(blocks.block_rows);

  for (int64_t first = 0; first < blocks.count(); first += blocks.block_rows) {
    const at::Tensor block = blocks.block(first);
    const int64_t rows = block.size(0);
    const at::Tensor hidden_block = in.hidden.index_select(0, block).to(in.accumulate);
    const at::Tensor block_labels = in.labels.index_select(0, block);
    const int64_t* labels = block_labels.const_data_ptr<int64_t>();
    std::fill(states.begin(), states.end(), SoftmaxState<acc_t>());
    for_each_slab(in.workers, in.slabs, [&](int64_t worker, int64_t slab) {
      for (int64_t tile = in.slabs.first_tile(slab); tile < in.slabs.end_tile(slab); ++tile) {
        const int64_t first_column = tile * kVocabTile;
        const int64_t cols = std::min(kVocabTile, vocab - first_column);
        at::Tensor logits = logits_buffers[worker].narrow(0, 0, rows * cols).view({rows, cols});
        at::cpu::mm_out(logits, hidden_block, weight_tiles.tile(worker, first_column, cols).t());
        fold_tile_of(logits.data_ptr<acc_t>(), rows, cols, scale,
                      scaled_bias == nullptr ? nullptr : scaled_bias + first_column,
                      states.data() + slab * blocks.block_rows, labels, first_column, label_logits.data());
      }
    });
    const int64_t* row_index = block.const_data_ptr<int64_t>();
    for (int64_t row = 0; row < rows; ++row) {
      SoftmaxState<acc_t> total;
      for (int64_t slab = 0; slab < in.slabs.count; ++slab) {
        total.merge(states[slab * blocks.block_rows + row]);
      }
      const int64_t index = row_index[row];
      lse.data_ptr<acc_t>()[index] = total.lse();
      mean_logit.data_ptr<acc_t>()[index] = total.mean_logit();
      logprobs.data_ptr<acc_t>()[index] = label_logits[row] - total.lse();
      entropy.data_ptr<acc_t>()[index] = total.entropy();
    }
  }
  return {logprobs, entropy, lse, mean_logit};
}

// `values` in the dtype and layout of `input`, as the fake implementation promises
// (empty_like): usually `values` itself, a copy only for 16-bit or strided inputs.
at::Tensor shaped_like(const at::Tensor& input, const at::Tensor& values) {
  if (values.scalar_type() == input.scalar_type() && values.strides() == input.strides()) {
    return values;
  }
  return at::empty_like(input).copy_(values);
}

// An upstream gradient in the accumulate type, zero on ignored rows.
at::Tensor row_gradient(const at::Tensor& grad, const at::Tensor& valid, at::ScalarType accumulate) {
  return at::where(valid, grad.detach().to(accumulate), at::zeros({}, valid.options().dtype(accumulate)));
}

template <typename acc_t>
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_impl(const LinearInputs& in, const at::Tensor& hidden_in,
                                                             const at::Tensor& weight_in,
                                                             const std::optional<at::Tensor>& bias_in,
                                                             const at::Tensor& grad_logprobs_in,
                                                             const std::optional<at::Tensor>& grad_entropy_in,
                                                             const at::Tensor& lse_in, const at::Tensor& mean_logit_in,
                                                             double temperature, int64_t ignore_index) {
  const int64_t num_rows = in.hidden.size(0);
  const int64_t hidden_size = in.hidden.size(1);
  const int64_t vocab = in.weight.size(0);
  const auto options = in.hidden.options().dtype(in.accumulate);
  const at::Tensor valid = in.labels != ignore_index;
  const at::Tensor grad_logprobs = row_gradient(grad_logprobs_in, valid, in.accumulate);
  const at::Tensor grad_entropy =
      grad_entropy_in.has_value() ? row_gradient(*grad_entropy_in, valid, in.accumulate) : at::Tensor();
  const at::Tensor lse = lse_in.detach().to(in.accumulate);
  const at::Tensor mean_logit = mean_logit_in.detach().to(in.accumulate);

  // Gradients accumulate in fp32/fp64 and are cast to the input dtype at the end.
  at::Tensor grad_hidden = at::zeros({num_rows, hidden_size}, options);
  at::Tensor grad_weight = at::zeros({vocab, hidden_size}, options);
  at::Tensor grad_bias = in.scaled_bias.defined() ? at::zeros({vocab}, options) : at::Tensor();

  const at::Tensor active = grad_entropy.defined() ? (grad_logprobs != 0).logical_or_(grad_entropy != 0)
                                                   : grad_logprobs != 0;
  const RowBlocks blocks(active, kRowBlock);
  const acc_t scale = static_cast<acc_t>(1.0 / temperature);
  const acc_t* scaled_bias = in.scaled_bias.defined() ? in.scaled_bias.const_data_ptr<acc_t>() : nullptr;
  WeightTiles weight_tiles(in.weight, in.accumulate, in.workers);
  std::vector<at::Tensor> logits_buffers;
  for (int64_t worker = 0; worker < in.workers; ++worker) {
    logits_buffers.push_back(at::empty({blocks.block_rows * kVocabTile}, options));
  }
  std::vector<at::Tensor> hidden_partials;
  for (int64_t slab = 0; slab < in.slabs.count; ++slab) {
    hidden_partials.push_back(at::empty({blocks.block_rows, hidden_size}, options));
  }

  for (int64_t first = 0; first < blocks.count(); first += blocks.block_rows) {
    const at::Tensor block = blocks.block(first);
    const int64_t rows = block.size(0);
    const at::Tensor hidden_block = in.hidden.index_select(0, block).to(in.accumulate);
    const at::Tensor block_labels = in.labels.index_select(0, block);
    const at::Tensor block_lse = lse.index_select(0, block);
    const at::Tensor block_mean = mean_logit.index_select(0, block);
    const at::Tensor block_grad = grad_logprobs.index_select(0, block);
    const at::Tensor block_grad_entropy = grad_entropy.defined() ? grad_entropy.index_select(0, block) : at::Tensor();
    for_each_slab(in.workers, in.slabs, [&](int64_t worker, int64_t slab) {
      at::Tensor hidden_gradient = hidden_partials[slab].narrow(0, 0, rows).zero_();
      for (int64_t tile = in.slabs.first_tile(slab); tile < in.slabs.end_tile(slab); ++tile) {
        const int64_t first_column = tile * kVocabTile;
        const int64_t cols = std::min(kVocabTile, vocab - first_column);
        const at::Tensor weight_tile = weight_tiles.tile(worker, first_column, cols);
        at::Tensor logits = logits_buffers[worker].narrow(0, 0, rows * cols).view({rows, cols});
        at::cpu::mm_out(logits, hidden_block, weight_tile.t());
        gradient_tile_of(logits.data_ptr<acc_t>(), rows, cols, scale,
                          scaled_bias == nullptr ? nullptr : scaled_bias + first_column,
                          block_lse.const_data_ptr<acc_t>(), block_mean.const_data_ptr<acc_t>(),
                          block_grad.const_data_ptr<acc_t>(),
                          block_grad_entropy.defined() ? block_grad_entropy.const_data_ptr<acc_t>() : nullptr,
                          block_labels.const_data_ptr<int64_t>(), first_column,
                          grad_bias.defined() ? grad_bias.data_ptr<acc_t>() + first_column : nullptr);
        at::Tensor weight_gradient = grad_weight.narrow(0, first_column, cols);
        at::cpu::addmm_out(weight_gradient, weight_gradient, logits.t(), hidden_block);
        at::cpu::addmm_out(hidden_gradient, hidden_gradient, logits, weight_tile);
      }
    });
    at::Tensor block_total = hidden_partials[0].narrow(0, 0, rows);
    for (int64_t slab = 1; slab < in.slabs.count; ++slab) {
      block_total.add_(hidden_partials[slab].narrow(0, 0, rows));
    }
    grad_hidden.index_copy_(0, block, block_total);
  }
  at::Tensor grad_bias_out =
      grad_bias.defined() ? shaped_like(*bias_in, grad_bias) : at::empty({0}, in.weight.options());
  return {shaped_like(hidden_in, grad_hidden), shaped_like(weight_in, grad_weight), grad_bias_out};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_logprob_forward_cpu(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& labels, double temperature, int64_t ignore_index, bool with_entropy) {
  // The entropy costs one multiply-add per logit next to the H of the GEMM, so it is
  // always formed: the outputs then mean the same whatever with_entropy says.
  (void)with_entropy;
  const LinearInputs in = prepare_inputs(hidden, weight, bias, labels, temperature, ignore_index);
  if (in.accumulate == at::kDouble) {
    return forward_impl<double>(in, temperature, ignore_index);
  }
  return forward_impl<float>(in, temperature, ignore_index);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_logprob_backward_cpu(
    const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
    const at::Tensor& weight, const std::optional<at::Tensor>& bias, const at::Tensor& labels, const at::Tensor& lse,
    const at::Tensor& mean_logit, double temperature, int64_t ignore_index) {
  const LinearInputs in = prepare_inputs(hidden, weight, bias, labels, temperature, ignore_index);
  const int64_t num_rows = in.hidden.size(0);
  for (const at::Tensor* row_tensor : {&grad_logprobs, &lse, &mean_logit}) {
    TORCH_CHECK(row_tensor->dim() == 1 && row_tensor->size(0) == num_rows,
                "hadw::linear_logprob_backward: per-row inputs must be [N] = [", num_rows, "], got ",
                row_tensor->sizes());
  }
  if (grad_entropy.has_value()) {
    TORCH_CHECK(grad_entropy->dim() == 1 && grad_entropy->size(0) == num_rows,
                "hadw::linear_logprob_backward: grad_entropy must be [N] = [", num_rows, "], got ",
                grad_entropy->sizes());
  }
  if (in.accumulate == at::kDouble) {
    return backward_impl<double>(in, hidden, weight, bias, grad_logprobs, grad_entropy, lse, mean_logit, temperature,
                                 ignore_index);
  }
  return backward_impl<float>(in, hidden, weight, bias, grad_logprobs, grad_entropy, lse, mean_logit, temperature,
                              ignore_index);
}

}  // namespace hadw
