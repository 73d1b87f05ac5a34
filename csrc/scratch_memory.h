// The memory and threading the linear kernels (linear_logprob.cpp) manage themselves:
// uninitialised aligned scratch, the logits buffer kept between calls, the LM head's
// gradient recycled between calls, and MKL held to one thread inside a slab's GEMMs.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/Allocator.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <utility>

namespace hadw {

struct FreeDeleter {
  void operator()(void* data) const { std::free(data); }
};
template <typename T>
using Scratch = std::unique_ptr<T[], FreeDeleter>;

// Scratch memory left uninitialised (std::vector would zero it: a pass over the whole
// buffer), aligned to a cache line.
template <typename T>
Scratch<T> uninitialized(int64_t count) {
  constexpr size_t kAlignment = 64;
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(T);
  void* data = std::aligned_alloc(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  TORCH_CHECK(data != nullptr, "hadw_cpp: cannot allocate ", bytes, " bytes of scratch memory");
  return Scratch<T>(static_cast<T*>(data));
}

// The logits buffer of linear_surrogate_forward, kept between calls: a fresh buffer of
// block_rows x V floats costs a page fault per page on first touch, a measurable share
// of a loss step; the kept one is already resident. Its size is the largest buffer asked
// for so far. A call that finds it in use (another thread) takes a buffer of its own.
// (Huge pages through madvise cut the faults but cost more: the kernel compacts memory
// to find them. Both measured in docs/architecture.md, "C++: the linear kernels".)
class LogitsWorkspace {
 public:
  class Lease {
   public:
    Lease(char* data, Scratch<char> own) : data_(data), own_(std::move(own)) {}
    Lease(Lease&& other) noexcept : data_(other.data_), own_(std::move(other.own_)) { other.data_ = nullptr; }
    Lease(const Lease&) = delete;
    ~Lease() {
      if (data_ != nullptr && own_ == nullptr) {
        std::lock_guard<std::mutex> lock(mutex());
        in_use() = false;
      }
    }
    template <typename T>
    T* as() const {
      return reinterpret_cast<T*>(data_);
    }

   private:
    char* data_;
    Scratch<char> own_;  // null when the shared buffer is lent
  };

  static Lease acquire(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex());
    if (in_use()) {
      Scratch<char> own = uninitialized<char>(static_cast<int64_t>(bytes));
      char* data = own.get();
      return Lease(data, std::move(own));
    }
    if (capacity() < bytes) {
      buffer().reset();  // free the old one before taking the larger one
      buffer() = uninitialized<char>(static_cast<int64_t>(bytes));
      capacity() = bytes;
    }
    in_use() = true;
    return Lease(buffer().get(), nullptr);
  }

 private:
  static std::mutex& mutex() {
    static std::mutex instance;
    return instance;
  }
  static bool& in_use() {
    static bool instance = false;
    return instance;
  }
  static size_t& capacity() {
    static size_t instance = 0;
    return instance;
  }
  static Scratch<char>& buffer() {
    static Scratch<char> instance;
    return instance;
  }
};

// The LM head's gradient, [V, H] in the compute type, is a new tensor on every call, and
// autograd frees it once it is accumulated into weight.grad (or stolen as weight.grad,
// later freed by zero_grad). Fresh memory costs a page fault per page on first write,
// system time every step that the bound, with its outputs preallocated, never pays
// (measured in docs/architecture.md, "C++: the linear kernels"). So the memory of the last such
// tensor freed is kept, and the next call of the same size writes its resident pages
// (one block per process, resident between calls like the logits buffer). The profiler
// hears of the tensor's allocation and free as it would from the CPU allocator, so its
// view of live memory stays true.
class RecycledGradient {
 public:
  static at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
    const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize();
    Scratch<char> block;
    {
      std::lock_guard<std::mutex> lock(state().mutex);
      if (state().kept != nullptr && state().kept_bytes == bytes) {
        block = std::move(state().kept);
      }
    }
    if (block == nullptr) {
      block = uninitialized<char>(static_cast<int64_t>(bytes));
    }
    char* data = block.release();
    report(data, static_cast<int64_t>(bytes));
    return at::from_blob(data, sizes, [bytes](void* freed) { give_back(static_cast<char*>(freed), bytes); },
                         options);
  }

 private:
  struct State {
    std::mutex mutex;
    Scratch<char> kept;
    size_t kept_bytes = 0;
    std::atomic<int64_t> live_bytes{0};  // as far as the profiler was told
  };

  // Never destroyed: a tensor may be freed while the process exits.
  static State& state() {
    static State* instance = new State();
    return *instance;
  }

  static void give_back(char* data, size_t bytes) {
    report(data, -static_cast<int64_t>(bytes));
    Scratch<char> older(data);
    std::lock_guard<std::mutex> lock(state().mutex);
    std::swap(state().kept, older);  // the newest is kept; `older` (if any) is freed on return
    state().kept_bytes = bytes;
  }

  static void report(void* data, int64_t delta) {
    if (c10::memoryProfilingEnabled()) {
      const int64_t live = state().live_bytes += delta;
      c10::reportMemoryUsageToProfiler(data, delta, static_cast<size_t>(std::max<int64_t>(live, 0)), 0,
                                       c10::Device(c10::DeviceType::CPU));
    }
  }
};

// MKL's thread count for the calling thread: the C entry point of mkl_service.h's
// mkl_set_num_threads_local (exported by torch builds with MKL; weak: null elsewhere).
// MKL splits the reduction of a skinny GEMM across its threads, which changes the
// rounding with the thread count, and it does so even inside these kernels' parallel
// region.
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

// Every GEMM of a slab runs on its worker thread alone, whatever the thread count.
class SequentialBlas {
 public:
  SequentialBlas() : previous_(MKL_Set_Num_Threads_Local != nullptr ? MKL_Set_Num_Threads_Local(1) : 0) {}
  ~SequentialBlas() {
    if (MKL_Set_Num_Threads_Local != nullptr) {
      MKL_Set_Num_Threads_Local(previous_);  // 0: back to the global setting
    }
  }
  SequentialBlas(const SequentialBlas&) = delete;
  SequentialBlas& operator=(const SequentialBlas&) = delete;

 private:
  int previous_;
};

}  // namespace hadw
