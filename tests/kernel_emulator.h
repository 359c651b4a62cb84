// A CPU stand-in for the CUDA features cswap_codec.cu uses, so that its kernels run, unchanged,
// on a machine without a GPU. tests/test_cuda_ext.py force-includes this header into
// tests/emulated_codec_harness.cpp, which includes a copy of the .cu (its headers written in
// place) whose `<<<...>>>` launches and `__shared__` declarations the test has rewritten, and
// builds it with the host compiler.
//
// Every CUDA thread runs on its own OS thread, and all the blocks of a launch run at once, so
// blocks that wait on each other (the look-back of a single-pass scan) make progress as on a
// GPU, in an order the OS scheduler picks. __syncthreads and the warp intrinsics are barriers,
// so a missing __syncthreads or a lane reading before another wrote shows up as wrong bytes or
// a crash. "Device" pointers are host pointers; the kernels' atomics are libcu++'s, which work
// on the host. Shared memory, static and dynamic, belongs to its block and starts out as
// garbage, as on a GPU.

#ifndef CSWAP_KERNEL_EMULATOR_H
#define CSWAP_KERNEL_EMULATOR_H

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)

#include <cuda_runtime.h>

#include <atomic>
#include <barrier>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace emu {

struct Idx {
  unsigned x = 0, y = 0, z = 0;
};

struct Config {
  unsigned grid, block;
  size_t smem;
  Config(uint64_t g, uint64_t b, size_t s = 0, cudaStream_t = nullptr)
      : grid(static_cast<unsigned>(g)), block(static_cast<unsigned>(b)), smem(s) {}
};

struct Block {
  std::unique_ptr<std::barrier<>> all;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<uint64_t> slots;  // one per thread, for the warp exchanges
  std::vector<unsigned char> smem;
  std::mutex statics_mutex;
  std::map<int, std::vector<unsigned char>> statics;  // by declaration
};

inline thread_local Idx thread_idx, block_idx, block_dim, grid_dim;
inline thread_local Block *current = nullptr;

inline std::barrier<> &warp_barrier() { return *current->warps[thread_idx.x / 32]; }

// Worker threads, kept from one launch to the next: a CUDA thread is a task run on one of them.
class Pool {
 public:
  // Runs task(0), ..., task(n - 1) concurrently, each on its own thread; returns when all have.
  void run(unsigned n, const std::function<void(unsigned)> &task) {
    std::unique_lock<std::mutex> lock(mutex_);
    while (threads_.size() < n) {
      const unsigned index = static_cast<unsigned>(threads_.size());
      threads_.emplace_back([this, index] { work(index); });
    }
    task_ = &task;
    active_ = remaining_ = n;
    ++generation_;
    start_.notify_all();
    done_.wait(lock, [this] { return remaining_ == 0; });
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    start_.notify_all();
    for (auto &t : threads_) t.join();
  }

 private:
  void work(unsigned index) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (index >= active_) continue;
      const auto *task = task_;
      lock.unlock();
      (*task)(index);
      lock.lock();
      if (--remaining_ == 0) done_.notify_one();
    }
  }

  std::mutex mutex_;
  std::condition_variable start_, done_;
  std::vector<std::thread> threads_;
  const std::function<void(unsigned)> *task_ = nullptr;
  unsigned active_ = 0, remaining_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

inline Pool pool;

// Runs `kernel` on `cfg.grid` blocks of `cfg.block` threads, all at once; returns when all
// have finished.
inline void launch(const Config &cfg, const std::function<void()> &kernel) {
  std::vector<std::unique_ptr<Block>> blocks;
  for (unsigned b = 0; b < cfg.grid; ++b) {
    auto block = std::make_unique<Block>();
    block->all = std::make_unique<std::barrier<>>(cfg.block);
    for (unsigned w = 0; w < cfg.block / 32; ++w)
      block->warps.push_back(std::make_unique<std::barrier<>>(32));
    block->slots.assign(cfg.block, 0);
    block->smem.assign(cfg.smem, 0xA5);
    blocks.push_back(std::move(block));
  }
  pool.run(cfg.grid * cfg.block, [&](unsigned i) {
    const unsigned b = i / cfg.block, t = i % cfg.block;
    Block &block = *blocks[b];
    current = &block;
    thread_idx = {t, 0, 0};
    block_idx = {b, 0, 0};
    block_dim = {cfg.block, 1, 1};
    grid_dim = {cfg.grid, 1, 1};
    kernel();
    // An exited thread no longer holds up the others, as on a GPU.
    block.warps[t / 32]->arrive_and_drop();
    block.all->arrive_and_drop();
    current = nullptr;
  });
}

template <typename T>
T *dynamic_smem() {
  return reinterpret_cast<T *>(current->smem.data());
}

// The block's copy of the `__shared__` variable declared at `line` (type A: T or T[N]).
template <typename A>
A &static_smem(int line) {
  std::lock_guard<std::mutex> lock(current->statics_mutex);
  std::vector<unsigned char> &bytes = current->statics[line];
  if (bytes.empty()) bytes.assign(sizeof(A), 0xA5);
  return *reinterpret_cast<A *>(bytes.data());
}

template <typename T>
uint64_t to_bits(T v) {
  uint64_t bits = 0;
  static_assert(sizeof(T) <= sizeof(bits));
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

template <typename T>
T from_bits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

// The value of `v` in lane `src(lane)` (the caller's own if src is outside the warp).
template <typename T, typename F>
T exchange(T v, F src) {
  const unsigned lane = thread_idx.x % 32, base = thread_idx.x - lane;
  current->slots[thread_idx.x] = to_bits(v);
  warp_barrier().arrive_and_wait();
  const int from = src(static_cast<int>(lane));
  T out = from >= 0 && from < 32 ? from_bits<T>(current->slots[base + from]) : v;
  warp_barrier().arrive_and_wait();
  return out;
}

}  // namespace emu

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::current->all->arrive_and_wait(); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }
inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
// A waiting thread lets the others run: they may be the ones it waits for.
inline void __nanosleep(unsigned) { std::this_thread::yield(); }

template <typename T>
T __shfl_up_sync(unsigned, T v, int d) {
  return emu::exchange(v, [d](int lane) { return lane - d; });
}
template <typename T>
T __shfl_down_sync(unsigned, T v, int d) {
  return emu::exchange(v, [d](int lane) { return lane + d; });
}
template <typename T>
T __shfl_xor_sync(unsigned, T v, int d) {
  return emu::exchange(v, [d](int lane) { return lane ^ d; });
}
template <typename T>
T __shfl_sync(unsigned, T v, int src) {
  return emu::exchange(v, [src](int) { return src; });
}
inline unsigned __ballot_sync(unsigned, int predicate) {
  const unsigned lane = threadIdx.x % 32, base = threadIdx.x - lane;
  emu::current->slots[threadIdx.x] = predicate != 0;
  emu::warp_barrier().arrive_and_wait();
  unsigned bits = 0;
  for (unsigned i = 0; i < 32; ++i) bits |= (emu::current->slots[base + i] ? 1u : 0u) << i;
  emu::warp_barrier().arrive_and_wait();
  return bits;
}
inline unsigned atomicOr(unsigned *p, unsigned v) {
  return std::atomic_ref<unsigned>(*p).fetch_or(v);
}
using std::isfinite;
using std::isinf;
using std::isnan;
template <typename T>
T min(T a, T b) {
  return b < a ? b : a;
}
template <typename T>
T max(T a, T b) {
  return a < b ? b : a;
}

// The runtime calls the library makes, on host memory.
extern "C" {
cudaError_t cudaMemsetAsync(void *p, int value, size_t n, cudaStream_t) {
  std::memset(p, value, n);
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
const char *cudaGetErrorString(cudaError_t) { return "emulated"; }
const char *cudaGetErrorName(cudaError_t) { return "emulated"; }
cudaError_t cudaGetDeviceCount(int *count) {
  *count = 1;
  return cudaSuccess;
}
}

#endif  // CSWAP_KERNEL_EMULATOR_H
