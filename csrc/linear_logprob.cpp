// CPU kernels of the linear ops (docs/math.md, section 6): log-probs of the labels, and the
// entropy, of softmax((h W^T + b) / temperature), and gradients, without [N, V] logits.
//
//   hadw_cpp::linear_logprob_forward    log-probs, entropy, lse, E_p[z] per row
//   hadw_cpp::linear_logprob_backward   grad_hidden, grad_weight, grad_bias, recomputing
//                                       the logits (any loss: GSPO's gradient is known
//                                       only after every log-prob of a response)
//   hadw_cpp::linear_surrogate_forward  log-probs, entropy and the gradients of a token-level
//                                       surrogate (an objective in the token ratio form) in
//                                       one sweep: three GEMMs
//
// Only active rows take part (label != ignore_index; in backward also a non-zero upstream
// gradient; in the surrogate's gradient GEMMs a non-zero token gradient), in blocks of
// rows. Inside a block the vocabulary is cut into tiles of kVocabTile columns, grouped
// into a fixed number of slabs of consecutive tiles that idle threads claim. Per tile:
// a BLAS GEMM of raw products, then, while they are in the core's cache, the logits
// z = raw / T + b / T in place and the online softmax statistics (forward), or the
// logits gradient g (onehot - p) - e p (z - E[z]) and its two GEMMs (backward). Each
// slab keeps its own partial results (softmax statistics, grad_hidden rows), combined in
// slab order; a grad_weight tile is written by one slab only. The slabs do not depend on
// the thread count, and each GEMM runs on one thread, so neither do the results.
//
// linear_surrogate_forward keeps the block's logits (a [block_rows, V] buffer, tile by
// tile) between the softmax statistics and the gradient: the surrogate's d loss / d logp
// of a token-level loss is known as soon as the row's log-prob is, so the block's
// gradients are formed without recomputing its logits (docs/architecture.md, "C++: the linear kernels").

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <ATen/ops/ne.h>
#include <ATen/ops/zeros.h>
#include <c10/core/Allocator.h>
#include <c10/util/BFloat16.h>
#include <c10/util/accumulate.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "scratch_memory.h"
#include "tile_math.h"
#include "token_math.h"

namespace hadw {
namespace {


// Vocabulary columns per tile of the forward / backward ops: a tile of
// kRecomputeBlockRows x 256 fp32 values stays well inside a core's L2.
constexpr int64_t kVocabTile = 256;
// Per tile of linear_surrogate_forward: its tiles live in the logits buffer anyway, so
// they are wider: fewer, larger GEMM calls ran faster (docs/architecture.md, "C++: the linear kernels").
constexpr int64_t kSurrogateTile = 2048;
// Slabs of tiles per block: partial results are per slab, so their count (not the
// thread count) fixes the summation order. More slabs than threads lets a thread slowed
// by other work on the machine delay its block by one slab, not by a fixed share.
constexpr int64_t kMaxSlabs = 16;
// Rows per block of the forward / backward ops (no logits buffer): a deep reduction
// (K = rows) for the grad_weight GEMM, few passes over W and grad_W.
constexpr int64_t kRecomputeBlockRows = 512;

// Row-major C[m, n] = op(A)[m, k] op(B)[k, n] (+ C when accumulating), A and B read
// transposed when asked (their storage is then [k, m] / [n, k]). ATen's CPU GEMM (MKL
// where torch has it) on views of the buffers: torch exports no BLAS entry point of its
// own, and a view's cost is negligible next to a tile's GEMM.
template <typename T>
void matmul(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b,
            int64_t ldb, bool accumulate, T* c, int64_t ldc) {
  const auto options = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  auto view = [&](const T* data, int64_t rows, int64_t cols, int64_t ld, bool transpose) {
    at::Tensor stored = at::from_blob(const_cast<T*>(data), {transpose ? cols : rows, transpose ? rows : cols},
                                      {ld, 1}, options);
    return transpose ? stored.t() : stored;
  };
  at::Tensor out = at::from_blob(c, {m, n}, {ldc, 1}, options);
  const at::Tensor left = view(a, m, k, lda, transpose_a);
  const at::Tensor right = view(b, k, n, ldb, transpose_b);
  if (accumulate) {
    at::cpu::addmm_out(out, out, left, right);
  } else {
    at::cpu::mm_out(out, left, right);
  }
}

// The tile functions for each compute type. fp32 is the hot path, compiled once per
// instruction set (HADW_VECTOR_CLONES); fp64 serves exact comparisons.
HADW_VECTOR_CLONES void fold_tile_of(float* tile, int64_t rows, int64_t cols, float scale, const float* scaled_bias,
                                     SoftmaxState<float>* states, const int64_t* labels, int64_t first_column,
                                     float* label_logits, float* shifts) {
  fold_tile(tile, rows, cols, scale, scaled_bias, states, labels, first_column, label_logits, shifts);
}

void fold_tile_of(double* tile, int64_t rows, int64_t cols, double scale, const double* scaled_bias,
                  SoftmaxState<double>* states, const int64_t* labels, int64_t first_column, double* label_logits,
                  double* shifts) {
  fold_tile(tile, rows, cols, scale, scaled_bias, states, labels, first_column, label_logits, shifts);
}

HADW_VECTOR_CLONES void scaled_probability_of(const float* numerators, int64_t in_ld, const int64_t* source,
                                              float* out, int64_t out_ld, int64_t rows, int64_t cols,
                                              const float* factor, const float* onehot, const int64_t* labels,
                                              int64_t first_column, float* bias_gradient) {
  scaled_probability_rows(numerators, in_ld, source, out, out_ld, rows, cols, factor, onehot, labels, first_column,
                          bias_gradient);
}

void scaled_probability_of(const double* numerators, int64_t in_ld, const int64_t* source, double* out,
                           int64_t out_ld, int64_t rows, int64_t cols, const double* factor, const double* onehot,
                           const int64_t* labels, int64_t first_column, double* bias_gradient) {
  scaled_probability_rows(numerators, in_ld, source, out, out_ld, rows, cols, factor, onehot, labels, first_column,
                          bias_gradient);
}

HADW_VECTOR_CLONES void to_logits_of(float* tile, int64_t rows, int64_t cols, float scale, const float* scaled_bias) {
  for (int64_t row = 0; row < rows; ++row) {
    to_logits(tile + row * cols, cols, scale, scaled_bias);
  }
}

void to_logits_of(double* tile, int64_t rows, int64_t cols, double scale, const double* scaled_bias) {
  for (int64_t row = 0; row < rows; ++row) {
    to_logits(tile + row * cols, cols, scale, scaled_bias);
  }
}

HADW_VECTOR_CLONES void logit_gradient_of(const float* z, int64_t z_ld, const int64_t* source, float* out,
                                          int64_t out_ld, int64_t rows, int64_t cols, float scale, const float* lse,
                                          const float* mean_logit, const float* grad_logprobs,
                                          const float* grad_entropy, const int64_t* labels, int64_t first_column,
                                          float* bias_gradient) {
  logit_gradient_rows(z, z_ld, source, out, out_ld, rows, cols, scale, lse, mean_logit, grad_logprobs, grad_entropy,
                      labels, first_column, bias_gradient);
}

void logit_gradient_of(const double* z, int64_t z_ld, const int64_t* source, double* out, int64_t out_ld,
                       int64_t rows, int64_t cols, double scale, const double* lse, const double* mean_logit,
                       const double* grad_logprobs, const double* grad_entropy, const int64_t* labels,
                       int64_t first_column, double* bias_gradient) {
  logit_gradient_rows(z, z_ld, source, out, out_ld, rows, cols, scale, lse, mean_logit, grad_logprobs, grad_entropy,
                      labels, first_column, bias_gradient);
}

struct Slabs {
  int64_t vocab = 0;
  int64_t columns = 0;  // per tile (the last one may have fewer)
  int64_t tiles = 0;
  int64_t count = 0;

  Slabs(int64_t vocab_size, int64_t tile_columns)
      : vocab(vocab_size),
        columns(tile_columns),
        tiles((vocab_size + tile_columns - 1) / tile_columns),
        count(std::min(tiles, kMaxSlabs)) {}
  int64_t first_tile(int64_t slab) const { return slab * tiles / count; }
  int64_t end_tile(int64_t slab) const { return (slab + 1) * tiles / count; }
  int64_t first_column(int64_t tile) const { return tile * columns; }
  int64_t cols(int64_t tile) const { return std::min(columns, vocab - tile * columns); }
};

// Runs work(worker, slab) for every slab on up to `workers` threads; `worker` indexes the
// calling thread's own buffers.
template <typename Work>
void for_each_slab(int64_t workers, const Slabs& slabs, const Work& work) {
  std::atomic<int64_t> next_slab{0};
  at::parallel_for(0, workers, 1, [&](int64_t first_worker, int64_t end_worker) {
    const SequentialBlas sequential;
    for (int64_t worker = first_worker; worker < end_worker; ++worker) {
      for (int64_t slab = next_slab++; slab < slabs.count; slab = next_slab++) {
        work(worker, slab);
      }
    }
  });
}

// Everything the three ops share: the inputs in the compute type and the sweep's layout.
struct LinearInputs {
  at::Tensor hidden;       // [N, H] input dtype
  at::Tensor weight;       // [V, H] contiguous, input dtype
  at::Tensor scaled_bias;  // [V] compute dtype, bias / temperature, or undefined
  at::Tensor labels;       // [N] int64
  at::ScalarType compute;
  int64_t vocab;
  int64_t hidden_size;
  Slabs slabs{1, 1};
  int64_t workers;
};

LinearInputs prepare_inputs(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const at::Tensor& labels, double temperature,
                            int64_t tile_columns) {
  TORCH_CHECK(hidden.dim() == 2, op, ": hidden must be [N, H], got ", hidden.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == hidden.size(1), op, ": weight must be [V, H] with H = ",
              hidden.size(1), ", got ", weight.sizes(),
              " (a ZeRO-3 LM head gathered for the forward must stay gathered through the backward)");
  TORCH_CHECK(weight.size(0) > 0, op, ": the vocabulary is empty");
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type(), op, ": hidden (", hidden.scalar_type(), ") and weight (",
              weight.scalar_type(), ") must share a dtype");
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": unsupported dtype ", dtype);
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == hidden.size(0), op, ": labels must be [N] = [", hidden.size(0),
              "], got ", labels.sizes());
  TORCH_CHECK(!at::isFloatingType(labels.scalar_type()), op, ": labels must be integers, got ", labels.scalar_type());
  TORCH_CHECK(temperature > 0 && std::isfinite(temperature), op, ": temperature must be positive and finite, got ",
              temperature);
  LinearInputs in;
  // Kernels see no autograd: worker threads do not inherit the caller's dispatch state.
  in.hidden = hidden.detach();
  in.weight = weight.detach().contiguous();
  in.compute = dtype == at::kDouble ? at::kDouble : at::kFloat;
  in.vocab = weight.size(0);
  in.hidden_size = hidden.size(1);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == in.vocab, op, ": bias must be [V] = [", in.vocab, "], got ",
                bias->sizes());
    in.scaled_bias = (bias->detach().to(in.compute) / temperature).contiguous();
  }
  in.labels = labels.detach().to(at::kLong).contiguous();
  in.slabs = Slabs(in.vocab, tile_columns);
  in.workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), in.slabs.count));
  return in;
}

// Per-row [N] inputs in the compute type, contiguous (a copy only when they are not).
at::Tensor per_row(const char* op, const char* name, const at::Tensor& tensor, int64_t rows, at::ScalarType compute) {
  TORCH_CHECK(tensor.dim() == 1 && tensor.size(0) == rows, op, ": ", name, " must be [N] = [", rows, "], got ",
              tensor.sizes());
  return tensor.detach().to(compute).contiguous();
}

// The LM head in the compute type, one tile at a time: an fp32/fp64 head is read in
// place; a bf16/fp16 head is widened tile by tile into the worker's own buffer (exactly:
// every bf16/fp16 value is an fp32 value), so the GEMMs accumulate in fp32 and the
// logits are never rounded to 16 bits.
template <typename T>
class WeightTiles {
 public:
  WeightTiles(const LinearInputs& in) : weight_(in.weight), hidden_size_(in.hidden_size) {
    if (weight_.scalar_type() != in.compute) {
      buffers_.resize(in.workers);
      for (auto& buffer : buffers_) {
        buffer.resize(in.slabs.columns * hidden_size_);
      }
    }
  }

  const T* tile(int64_t worker, int64_t first_column, int64_t cols) {
    const int64_t offset = first_column * hidden_size_;
    if (buffers_.empty()) {
      return weight_.const_data_ptr<T>() + offset;
    }
    T* out = buffers_[worker].data();
    const int64_t count = cols * hidden_size_;
    if constexpr (std::is_same_v<T, float>) {
      if (weight_.scalar_type() == at::kBFloat16) {
        widen(weight_.const_data_ptr<c10::BFloat16>() + offset, out, count);
      } else {
        widen(weight_.const_data_ptr<c10::Half>() + offset, out, count);
      }
    }
    return out;
  }

 private:
  template <typename Narrow>
  static void widen(const Narrow* in, T* out, int64_t count) {
    for (int64_t i = 0; i < count; ++i) {
      out[i] = static_cast<T>(in[i]);
    }
  }

  at::Tensor weight_;
  int64_t hidden_size_;
  std::vector<std::vector<T>> buffers_;
};

// A block of active rows: their hidden states in the compute type, their labels.
struct Block {
  at::Tensor index;   // [rows] int64, positions in the N rows
  at::Tensor hidden;  // [rows, H] compute type, contiguous
  at::Tensor labels;  // [rows] int64
  int64_t rows = 0;
};

// The active rows, cut into blocks of at most `block_rows`.
class RowBlocks {
 public:
  RowBlocks(const at::Tensor& active, int64_t block_rows)
      : rows_(active.nonzero().flatten()), block_rows_(std::max<int64_t>(1, std::min(block_rows, rows_.size(0)))) {}
  int64_t count() const { return rows_.size(0); }
  int64_t block_rows() const { return block_rows_; }

  Block block(const LinearInputs& in, int64_t first) const {
    Block block;
    block.index = rows_.narrow(0, first, std::min(block_rows_, count() - first));
    block.rows = block.index.size(0);
    if (count() == in.hidden.size(0)) {
      // Every row active (no padding): the block is a slice, no gather.
      block.hidden = in.hidden.narrow(0, first, block.rows).to(in.compute).contiguous();
      block.labels = in.labels.narrow(0, first, block.rows).contiguous();
    } else {
      block.hidden = at::index_select(in.hidden, 0, block.index).to(in.compute).contiguous();
      block.labels = at::index_select(in.labels, 0, block.index);
    }
    return block;
  }

 private:
  at::Tensor rows_;
  int64_t block_rows_;
};

// The softmax statistics of a block's rows, slab by slab, then merged in slab order.
template <typename T>
class BlockStatistics {
 public:
  BlockStatistics(const Slabs& slabs, int64_t block_rows)
      : slabs_(slabs), block_rows_(block_rows), states_(slabs.count * block_rows), label_logits_(block_rows) {}

  void reset() {
    std::fill(states_.begin(), states_.end(), SoftmaxState<T>());
    std::fill(label_logits_.begin(), label_logits_.end(), std::numeric_limits<T>::quiet_NaN());
  }
  SoftmaxState<T>* slab_states(int64_t slab) { return states_.data() + slab * block_rows_; }
  T* label_logits() { return label_logits_.data(); }
  const T* label_logits() const { return label_logits_.data(); }

  SoftmaxState<T> row(int64_t row) const {
    SoftmaxState<T> total;
    for (int64_t slab = 0; slab < slabs_.count; ++slab) {
      total.merge(states_[slab * block_rows_ + row]);
    }
    return total;
  }

 private:
  Slabs slabs_;
  int64_t block_rows_;
  std::vector<SoftmaxState<T>> states_;
  std::vector<T> label_logits_;
};

// Writes logp, entropy, lse and E_p[z] of a block's rows into the [N] outputs. A label
// outside the vocabulary gives a NaN log-prob (check_values reports it in Python).
template <typename T>
void write_row_outputs(const LinearInputs& in, const Block& block, const BlockStatistics<T>& statistics, T* logprobs,
                       T* entropy, T* lse, T* mean_logit) {
  const int64_t* index = block.index.const_data_ptr<int64_t>();
  const int64_t* labels = block.labels.const_data_ptr<int64_t>();
  for (int64_t row = 0; row < block.rows; ++row) {
    const SoftmaxState<T> total = statistics.row(row);
    const int64_t position = index[row];
    const bool in_vocab = labels[row] >= 0 && labels[row] < in.vocab;
    const T row_lse = total.lse();
    lse[position] = row_lse;
    mean_logit[position] = total.mean_logit();
    entropy[position] = total.entropy();
    logprobs[position] =
        in_vocab ? statistics.label_logits()[row] - row_lse : std::numeric_limits<T>::quiet_NaN();
  }
}

// Phase 1 of a block: per tile, raw = h W_tile^T into `logits_tile(worker, tile)` (ld =
// the tile's columns), turned into logits in place and folded into the slab's statistics.
// With `shifts` ([tiles][block rows]), tiles are left holding softmax numerators
// (fold_tile).
template <typename T, typename TileOf>
void forward_block(const LinearInputs& in, const Block& block, WeightTiles<T>& weight_tiles,
                   BlockStatistics<T>& statistics, T scale, const TileOf& logits_tile, T* shifts = nullptr) {
  const T* scaled_bias = in.scaled_bias.defined() ? in.scaled_bias.const_data_ptr<T>() : nullptr;
  const T* hidden = block.hidden.const_data_ptr<T>();
  const int64_t* labels = block.labels.const_data_ptr<int64_t>();
  statistics.reset();
  for_each_slab(in.workers, in.slabs, [&](int64_t worker, int64_t slab) {
    for (int64_t tile = in.slabs.first_tile(slab); tile < in.slabs.end_tile(slab); ++tile) {
      const int64_t first_column = in.slabs.first_column(tile);
      const int64_t cols = in.slabs.cols(tile);
      T* logits = logits_tile(worker, tile);
      matmul<T>(false, true, block.rows, cols, in.hidden_size, hidden, in.hidden_size,
                weight_tiles.tile(worker, first_column, cols), in.hidden_size, false, logits, cols);
      fold_tile_of(logits, block.rows, cols, scale, scaled_bias == nullptr ? nullptr : scaled_bias + first_column,
                   statistics.slab_states(slab), labels, first_column, statistics.label_logits(),
                   shifts == nullptr ? nullptr : shifts + tile * block.rows);
    }
  });
}

// The gradient GEMMs of a block, given per tile the logits gradient of its `rows` rows
// (hidden_rows: their hidden states [rows, H]): grad_weight's tile (+)= dz^T h, the
// slab's partial grad_hidden (+)= dz W_tile, then the partials summed in slab order into
// grad_hidden's rows `index`.
template <typename T>
class GradientAccumulator {
 public:
  // `partials`: partials_size(in, block_rows) values of scratch memory.
  GradientAccumulator(const LinearInputs& in, int64_t block_rows, T* grad_weight, T* partials)
      : in_(in), grad_weight_(grad_weight), partials_(partials), partial_stride_(block_rows * in.hidden_size) {}

  static int64_t partials_size(const LinearInputs& in, int64_t block_rows) {
    return in.slabs.count * block_rows * in.hidden_size;
  }

  // Runs on the slab's thread, for each tile of the slab in order.
  void add_tile(int64_t slab, bool first_tile_of_slab, int64_t first_column, int64_t cols, const T* dz,
                int64_t rows, const T* hidden_rows, const T* weight_tile) {
    const int64_t hidden_size = in_.hidden_size;
    matmul<T>(true, false, cols, hidden_size, rows, dz, cols, hidden_rows, hidden_size, weight_started_,
              grad_weight_ + first_column * hidden_size, hidden_size);
    matmul<T>(false, false, rows, hidden_size, cols, dz, cols, weight_tile, hidden_size, !first_tile_of_slab,
              partials_ + slab * partial_stride_, hidden_size);
  }

  // After every slab of the block: grad_hidden[index[k]] = sum over slabs of partial[k].
  void finish_block(int64_t rows, const int64_t* index, T* grad_hidden) {
    const int64_t hidden_size = in_.hidden_size;
    at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
      for (int64_t row = first; row < last; ++row) {
        T* out = grad_hidden + index[row] * hidden_size;
        std::memcpy(out, partials_ + row * hidden_size, hidden_size * sizeof(T));
        for (int64_t slab = 1; slab < in_.slabs.count; ++slab) {
          const T* partial = partials_ + slab * partial_stride_ + row * hidden_size;
          for (int64_t col = 0; col < hidden_size; ++col) {
            out[col] += partial[col];
          }
        }
      }
    });
    weight_started_ = true;
  }

  // grad_weight is zero where no block wrote it.
  void finish() {
    if (!weight_started_) {
      std::fill(grad_weight_, grad_weight_ + in_.vocab * in_.hidden_size, T(0));
    }
  }

 private:
  const LinearInputs& in_;
  T* grad_weight_;
  bool weight_started_ = false;
  T* partials_;  // per slab, [block rows, H]
  int64_t partial_stride_;
};

// `values` in the dtype and layout of `input`, as the fake implementation promises
// (empty_like): `values` itself for fp32/fp64 contiguous inputs, else a copy.
at::Tensor shaped_like(const at::Tensor& input, const at::Tensor& values) {
  if (values.scalar_type() == input.scalar_type() && values.strides() == input.strides()) {
    return values;
  }
  return at::empty_like(input).copy_(values);
}

// The gradient outputs, accumulated in the compute type and returned in the inputs'.
struct GradientOutputs {
  at::Tensor grad_hidden;  // [N, H] compute type, zero on rows without a gradient
  at::Tensor grad_weight;  // [V, H] compute type (filled by GradientAccumulator)
  at::Tensor grad_bias;    // [V] compute type, or undefined

  GradientOutputs(const LinearInputs& in) {
    const auto options = in.hidden.options().dtype(in.compute);
    grad_hidden = at::zeros({in.hidden.size(0), in.hidden_size}, options);
    grad_weight = RecycledGradient::empty({in.vocab, in.hidden_size}, options);
    if (in.scaled_bias.defined()) {
      grad_bias = at::zeros({in.vocab}, options);
    }
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor> result(const at::Tensor& hidden, const at::Tensor& weight,
                                                        const std::optional<at::Tensor>& bias) const {
    at::Tensor bias_out = grad_bias.defined() ? shaped_like(*bias, grad_bias) : at::empty({0}, weight.options());
    return {shaped_like(hidden, grad_hidden), shaped_like(weight, grad_weight), bias_out};
  }
};

template <typename T>
T* data_or_null(const at::Tensor& tensor) {
  return tensor.defined() ? tensor.data_ptr<T>() : nullptr;
}

// --- linear_logprob_forward -----------------------------------------------------------

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_impl(const LinearInputs& in, double temperature,
                                                                         int64_t ignore_index) {
  const int64_t num_rows = in.hidden.size(0);
  const auto options = in.hidden.options().dtype(in.compute);
  // Ignored rows: log-prob and entropy 0; their lse and mean logit are never used.
  at::Tensor logprobs = at::zeros({num_rows}, options);
  at::Tensor entropy = at::zeros({num_rows}, options);
  at::Tensor lse = at::zeros({num_rows}, options);
  at::Tensor mean_logit = at::zeros({num_rows}, options);

  const RowBlocks blocks(at::ne(in.labels, ignore_index), kRecomputeBlockRows);
  const T scale = static_cast<T>(1.0 / temperature);
  WeightTiles<T> weight_tiles(in);
  std::vector<Scratch<T>> tiles;
  for (int64_t worker = 0; worker < in.workers; ++worker) {
    tiles.push_back(uninitialized<T>(blocks.block_rows() * in.slabs.columns));
  }
  BlockStatistics<T> statistics(in.slabs, blocks.block_rows());
  for (int64_t first = 0; first < blocks.count(); first += blocks.block_rows()) {
    const Block block = blocks.block(in, first);
    forward_block<T>(in, block, weight_tiles, statistics, scale,
                     [&](int64_t worker, int64_t) { return tiles[worker].get(); });
    write_row_outputs<T>(in, block, statistics, logprobs.data_ptr<T>(), entropy.data_ptr<T>(),
                         lse.data_ptr<T>(), mean_logit.data_ptr<T>());
  }
  return {logprobs, entropy, lse, mean_logit};
}

// --- linear_logprob_backward ----------------------------------------------------------

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_impl(const LinearInputs& in, const at::Tensor& hidden_in,
                                                             const at::Tensor& weight_in,
                                                             const std::optional<at::Tensor>& bias_in,
                                                             const at::Tensor& grad_logprobs,
                                                             const at::Tensor& grad_entropy, const at::Tensor& lse,
                                                             const at::Tensor& mean_logit, double temperature,
                                                             int64_t ignore_index) {
  GradientOutputs outputs(in);
  // Rows that take part: not ignored, and a non-zero upstream gradient (padding, clipped
  // tokens and degenerate groups cost no GEMM). NaN is non-zero.
  at::Tensor active = at::ne(grad_logprobs, 0);
  if (grad_entropy.defined()) {
    active.logical_or_(at::ne(grad_entropy, 0));
  }
  active.logical_and_(at::ne(in.labels, ignore_index));
  const RowBlocks blocks(active, kRecomputeBlockRows);
  const T scale = static_cast<T>(1.0 / temperature);
  const T* scaled_bias = in.scaled_bias.defined() ? in.scaled_bias.const_data_ptr<T>() : nullptr;
  T* grad_bias = data_or_null<T>(outputs.grad_bias);
  WeightTiles<T> weight_tiles(in);
  std::vector<Scratch<T>> tiles;
  for (int64_t worker = 0; worker < in.workers; ++worker) {
    tiles.push_back(uninitialized<T>(blocks.block_rows() * in.slabs.columns));
  }
  const Scratch<T> partials = uninitialized<T>(GradientAccumulator<T>::partials_size(in, blocks.block_rows()));
  GradientAccumulator<T> accumulator(in, blocks.block_rows(), outputs.grad_weight.data_ptr<T>(), partials.get());

  for (int64_t first = 0; first < blocks.count(); first += blocks.block_rows()) {
    const Block block = blocks.block(in, first);
    const at::Tensor block_lse = at::index_select(lse, 0, block.index);
    const at::Tensor block_mean = at::index_select(mean_logit, 0, block.index);
    const at::Tensor block_grad = at::index_select(grad_logprobs, 0, block.index);
    const at::Tensor block_grad_entropy =
        grad_entropy.defined() ? at::index_select(grad_entropy, 0, block.index) : at::Tensor();
    const T* hidden = block.hidden.const_data_ptr<T>();
    for_each_slab(in.workers, in.slabs, [&](int64_t worker, int64_t slab) {
      for (int64_t tile = in.slabs.first_tile(slab); tile < in.slabs.end_tile(slab); ++tile) {
        const int64_t first_column = in.slabs.first_column(tile);
        const int64_t cols = in.slabs.cols(tile);
        const T* weight_tile = weight_tiles.tile(worker, first_column, cols);
        T* logits = tiles[worker].get();
        matmul<T>(false, true, block.rows, cols, in.hidden_size, hidden, in.hidden_size, weight_tile,
                  in.hidden_size, false, logits, cols);
        to_logits_of(logits, block.rows, cols, scale, scaled_bias == nullptr ? nullptr : scaled_bias + first_column);
        logit_gradient_of(logits, cols, nullptr, logits, cols, block.rows, cols, scale, block_lse.const_data_ptr<T>(),
                          block_mean.const_data_ptr<T>(), block_grad.const_data_ptr<T>(),
                          block_grad_entropy.defined() ? block_grad_entropy.const_data_ptr<T>() : nullptr,
                          block.labels.const_data_ptr<int64_t>(), first_column,
                          grad_bias == nullptr ? nullptr : grad_bias + first_column);
        accumulator.add_tile(slab, tile == in.slabs.first_tile(slab), first_column, cols, logits, block.rows, hidden,
                             weight_tile);
      }
    });
    accumulator.finish_block(block.rows, block.index.const_data_ptr<int64_t>(), outputs.grad_hidden.data_ptr<T>());
  }
  accumulator.finish();
  return outputs.result(hidden_in, weight_in, bias_in);
}

// --- linear_surrogate_forward ---------------------------------------------------------

// The token-level surrogate's inputs, [N] in the compute type.
template <typename T>
struct TokenInputs {
  const T* old_logprobs;  // null: on-policy (old = the row's own log-prob)
  const T* advantages;
  const T* agg_weights;
  const T* ref_logprobs;  // null unless beta > 0
  const T* importance_weights;  // or null
  int64_t objective;  // a config::kObjective code that takes the token ratio
  ObjectiveOptions<T> options;
  T beta;
  int64_t kl_estimator;
  T entropy_coef;
};

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> surrogate_impl(
    const LinearInputs& in, const at::Tensor& hidden_in, const at::Tensor& weight_in,
    const std::optional<at::Tensor>& bias_in, const TokenInputs<T>& tokens, double temperature, int64_t ignore_index,
    int64_t block_rows) {
  const int64_t num_rows = in.hidden.size(0);
  const int64_t hidden_size = in.hidden_size;
  const auto options = in.hidden.options().dtype(in.compute);
  at::Tensor logprobs = at::zeros({num_rows}, options);
  at::Tensor entropy = at::zeros({num_rows}, options);
  GradientOutputs outputs(in);
  T* logprob_data = logprobs.data_ptr<T>();
  T* entropy_data = entropy.data_ptr<T>();
  T* grad_bias = data_or_null<T>(outputs.grad_bias);

  const RowBlocks blocks(at::ne(in.labels, ignore_index), block_rows);
  const int64_t capacity = blocks.block_rows();
  const T scale = static_cast<T>(1.0 / temperature);
  WeightTiles<T> weight_tiles(in);
  BlockStatistics<T> statistics(in.slabs, capacity);

  // The block's logits (tile-major: tile j is [rows, cols] contiguous at j * rows *
  // columns) and the grad_hidden partials, in the buffer kept between calls.
  const int64_t logits_size = capacity * in.slabs.tiles * in.slabs.columns;
  const int64_t partials_size = GradientAccumulator<T>::partials_size(in, capacity);
  const LogitsWorkspace::Lease workspace =
      LogitsWorkspace::acquire(static_cast<size_t>(logits_size + partials_size) * sizeof(T));
  T* const logits_data = workspace.as<T>();
  GradientAccumulator<T> accumulator(in, capacity, outputs.grad_weight.data_ptr<T>(), logits_data + logits_size);
  // Without an entropy term the tiles keep softmax numerators exp(z - shift) (one per
  // tile and row), and the gradient pass needs no exp (tile_math.h).
  const bool numerators = !(tokens.entropy_coef > 0);
  const Scratch<T> shifts = uninitialized<T>(numerators ? capacity * in.slabs.tiles : 0);
  std::vector<Scratch<T>> factors, onehots;
  for (int64_t worker = 0; worker < in.workers; ++worker) {
    factors.push_back(uninitialized<T>(capacity));
    onehots.push_back(uninitialized<T>(capacity));
  }
  // Per block row (compacted to the rows with a gradient): the values of the logits gradient.
  std::vector<int64_t> source(capacity), labels(capacity);
  std::vector<T> lse(capacity), mean_logit(capacity), grad(capacity), grad_entropy(capacity);
  std::vector<T> compact_hidden;

  for (int64_t first = 0; first < blocks.count(); first += capacity) {
    const Block block = blocks.block(in, first);
    const int64_t tile_stride = block.rows * in.slabs.columns;
    forward_block<T>(in, block, weight_tiles, statistics, scale,
                     [&](int64_t, int64_t tile) { return logits_data + tile * tile_stride; },
                     numerators ? shifts.get() : nullptr);

    // Per row: log-prob, entropy and the token's d loss / d logp, d loss / d entropy.
    const int64_t* index = block.index.const_data_ptr<int64_t>();
    const int64_t* block_labels = block.labels.const_data_ptr<int64_t>();
    int64_t active = 0;
    for (int64_t row = 0; row < block.rows; ++row) {
      const SoftmaxState<T> total = statistics.row(row);
      const int64_t position = index[row];
      const bool in_vocab = block_labels[row] >= 0 && block_labels[row] < in.vocab;
      const T row_lse = total.lse();
      const T logprob = in_vocab ? statistics.label_logits()[row] - row_lse : std::numeric_limits<T>::quiet_NaN();
      logprob_data[position] = logprob;
      entropy_data[position] = total.entropy();
      const T old = tokens.old_logprobs == nullptr ? logprob : tokens.old_logprobs[position];
      const T agg_weight = tokens.agg_weights[position];
      // (No objective that selects tokens takes this path: the loss forms their log-probs first.)
      T slope = token_policy_term(tokens.objective, logprob, old, tokens.advantages[position], T(0),
                                  tokens.options).slope;
      if (tokens.importance_weights != nullptr) {
        slope *= tokens.importance_weights[position];
      }
      if (tokens.ref_logprobs != nullptr) {
        slope += tokens.beta * kl_term(tokens.kl_estimator, logprob, tokens.ref_logprobs[position]).slope;
      }
      const T g = slope * agg_weight;
      const T g_entropy = tokens.entropy_coef > 0 ? -tokens.entropy_coef * agg_weight : T(0);
      // Rows without a gradient (clipped tokens, zero advantages) enter no gradient GEMM.
      if (g != 0 || g_entropy != 0) {
        source[active] = row;
        labels[active] = block_labels[row];
        lse[active] = row_lse;
        mean_logit[active] = total.mean_logit();
        grad[active] = g;
        grad_entropy[active] = g_entropy;
        ++active;
      }
    }
    if (active == 0) {
      continue;
    }
    const T* hidden_rows = block.hidden.const_data_ptr<T>();
    if (active < block.rows) {
      compact_hidden.resize(active * hidden_size);
      for (int64_t k = 0; k < active; ++k) {
        std::memcpy(compact_hidden.data() + k * hidden_size, hidden_rows + source[k] * hidden_size,
                    hidden_size * sizeof(T));
      }
      hidden_rows = compact_hidden.data();
    }
    for_each_slab(in.workers, in.slabs, [&](int64_t worker, int64_t slab) {
      T* factor = factors[worker].get();
      T* onehot = onehots[worker].get();
      for (int64_t tile = in.slabs.first_tile(slab); tile < in.slabs.end_tile(slab); ++tile) {
        const int64_t first_column = in.slabs.first_column(tile);
        const int64_t cols = in.slabs.cols(tile);
        // The gradient replaces the tile's values in place, rows compacted to the active ones.
        T* tile_values = logits_data + tile * tile_stride;
        T* bias_tile = grad_bias == nullptr ? nullptr : grad_bias + first_column;
        if (numerators) {
          const T* tile_shifts = shifts.get() + tile * block.rows;
          for (int64_t k = 0; k < active; ++k) {
            factor[k] = -grad[k] * scale * std::exp(tile_shifts[source[k]] - lse[k]);
            onehot[k] = grad[k] * scale;
          }
          scaled_probability_of(tile_values, cols, source.data(), tile_values, cols, active, cols, factor, onehot,
                                labels.data(), first_column, bias_tile);
        } else {
          logit_gradient_of(tile_values, cols, source.data(), tile_values, cols, active, cols, scale, lse.data(),
                            mean_logit.data(), grad.data(), grad_entropy.data(), labels.data(), first_column,
                            bias_tile);
        }
        accumulator.add_tile(slab, tile == in.slabs.first_tile(slab), first_column, cols, tile_values, active,
                             hidden_rows, weight_tiles.tile(worker, first_column, cols));
      }
    });
    std::vector<int64_t> positions(active);
    for (int64_t k = 0; k < active; ++k) {
      positions[k] = index[source[k]];
    }
    accumulator.finish_block(active, positions.data(), outputs.grad_hidden.data_ptr<T>());
  }
  accumulator.finish();
  auto [grad_hidden, grad_weight, grad_bias_out] = outputs.result(hidden_in, weight_in, bias_in);
  return {logprobs, entropy, grad_hidden, grad_weight, grad_bias_out};
}

}  // namespace

const char* row_kernels() { return row_kernels_name(selected_row_kernels()); }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_logprob_forward_cpu(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& labels, double temperature, int64_t ignore_index, bool with_entropy) {
  // The entropy costs one multiply-add per logit next to the H of the GEMM, so it is
  // always formed: the outputs then mean the same whatever with_entropy says.
  (void)with_entropy;
  const LinearInputs in =
      prepare_inputs("hadw_cpp::linear_logprob_forward", hidden, weight, bias, labels, temperature, kVocabTile);
  if (in.compute == at::kDouble) {
    return forward_impl<double>(in, temperature, ignore_index);
  }
  return forward_impl<float>(in, temperature, ignore_index);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_logprob_backward_cpu(
    const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
    const at::Tensor& weight, const std::optional<at::Tensor>& bias, const at::Tensor& labels, const at::Tensor& lse,
    const at::Tensor& mean_logit, double temperature, int64_t ignore_index) {
  constexpr const char* op = "hadw_cpp::linear_logprob_backward";
  const LinearInputs in = prepare_inputs(op, hidden, weight, bias, labels, temperature, kVocabTile);
  const int64_t rows = in.hidden.size(0);
  const at::Tensor upstream = per_row(op, "grad_logprobs", grad_logprobs, rows, in.compute);
  const at::Tensor upstream_entropy =
      grad_entropy.has_value() ? per_row(op, "grad_entropy", *grad_entropy, rows, in.compute) : at::Tensor();
  const at::Tensor row_lse = per_row(op, "lse", lse, rows, in.compute);
  const at::Tensor row_mean = per_row(op, "mean_logit", mean_logit, rows, in.compute);
  if (in.compute == at::kDouble) {
    return backward_impl<double>(in, hidden, weight, bias, upstream, upstream_entropy, row_lse, row_mean, temperature,
                                 ignore_index);
  }
  return backward_impl<float>(in, hidden, weight, bias, upstream, upstream_entropy, row_lse, row_mean, temperature,
                              ignore_index);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_surrogate_forward_cpu(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& labels, const std::optional<at::Tensor>& old_logprobs, const at::Tensor& advantages,
    const at::Tensor& agg_weights, const std::optional<at::Tensor>& ref_logprobs,
    const std::optional<at::Tensor>& importance_weights, double temperature, int64_t ignore_index, int64_t objective,
    double epsilon_low, double epsilon_high, c10::ArrayRef<double> objective_options, double beta,
    int64_t kl_estimator, double entropy_coef, bool with_entropy, int64_t block_rows) {
  constexpr const char* op = "hadw_cpp::linear_surrogate_forward";
  (void)with_entropy;  // the entropy is always formed (see linear_logprob_forward_cpu)
  const LinearInputs in = prepare_inputs(op, hidden, weight, bias, labels, temperature, kSurrogateTile);
  TORCH_CHECK(kl_estimator >= 0 && kl_estimator < config::kKlCount, op,
              ": kl_estimator must index config.KL_ESTIMATORS, got ", kl_estimator);
  TORCH_CHECK(objective >= 0 && objective < config::kObjectiveCount, op,
              ": objective must index config.OBJECTIVE_NAMES, got ", objective);
  check_objective_options(op, objective, objective_options);
  // A token's gradient here is known from its own log-prob alone; an objective that reads
  // its whole response (a sequence ratio) takes the linear loss's recompute path.
  TORCH_CHECK(config::kObjectiveTakesRatioLevel[objective][config::kRatioLevelToken], op, ": objective ", objective,
              " has no token ratio form (config.OBJECTIVES): use the recompute path");
  // The default (0 at the hadw:: op) is config.block_rows_for's, resolved by the backend
  // in Python (hadw_kernels/backends/cpp_backend.py): one formula.
  TORCH_CHECK(block_rows > 0, op, ": block_rows must be positive, got ", block_rows);
  const int64_t rows = in.hidden.size(0);
  // Kept alive for the pointers below.
  const at::Tensor old = old_logprobs.has_value() ? per_row(op, "old_logprobs", *old_logprobs, rows, in.compute)
                                                  : at::Tensor();
  const at::Tensor advantage = per_row(op, "advantages", advantages, rows, in.compute);
  const at::Tensor agg = per_row(op, "agg_weights", agg_weights, rows, in.compute);
  at::Tensor ref;
  if (beta > 0) {
    TORCH_CHECK(ref_logprobs.has_value(), op, ": beta > 0 needs ref_logprobs");
    ref = per_row(op, "ref_logprobs", *ref_logprobs, rows, in.compute);
  }
  const at::Tensor importance = importance_weights.has_value()
                                    ? per_row(op, "importance_weights", *importance_weights, rows, in.compute)
                                    : at::Tensor();
  auto run = [&](auto zero) {
    using T = decltype(zero);
    TokenInputs<T> tokens;
    tokens.old_logprobs = old.defined() ? old.const_data_ptr<T>() : nullptr;
    tokens.advantages = advantage.const_data_ptr<T>();
    tokens.agg_weights = agg.const_data_ptr<T>();
    tokens.ref_logprobs = ref.defined() ? ref.const_data_ptr<T>() : nullptr;
    tokens.importance_weights = importance.defined() ? importance.const_data_ptr<T>() : nullptr;
    tokens.objective = objective;
    tokens.options = ObjectiveOptions<T>::from(epsilon_low, epsilon_high, objective_options);
    tokens.beta = static_cast<T>(beta);
    tokens.kl_estimator = kl_estimator;
    tokens.entropy_coef = static_cast<T>(entropy_coef);
    return surrogate_impl<T>(in, hidden, weight, bias, tokens, temperature, ignore_index, block_rows);
  };
  if (in.compute == at::kDouble) {
    return run(0.0);
  }
  return run(0.0f);
}

}  // namespace hadw
