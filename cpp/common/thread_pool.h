// A persistent worker pool shared by every operator (GEMV, KV-store attention).
//
// parallel_for(n_tasks, n_threads, fn) runs fn(i) exactly once for each i in [0, n_tasks), on at most
// n_threads threads, the caller included. Tasks are claimed one at a time from a shared counter, so a
// worker that the OS has descheduled (a busy 2-core machine) does not stall the call: the caller takes
// its tasks. Determinism is the kernels' contract: task i writes only outputs owned by i, and any
// reduction over tasks happens afterwards in a fixed order; then 1 or N threads give the same bits.
//
// Workers spin briefly (decode issues one call per layer and op, microseconds apart), then sleep on
// a condition variable so an idle runtime costs no CPU. set_spin_us lengthens the spin while a caller
// knows more calls come soon after a pause longer than the default (a GPU decode step: a layer's device
// work between two store parts), so the workers stay hot instead of waking from the condition variable.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace ktq {

// A spin-wait hint: x86's PAUSE (frees the pipeline for the core's other work), a yield elsewhere.
inline void cpu_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

class ThreadPool {
 public:
  static ThreadPool& global();

  ThreadPool() = default;
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // How long an idle worker spins before it sleeps (microseconds, default kDefaultSpinUs); read at
  // every check, so a shorter value sends spinning workers to sleep soon.
  static constexpr int64_t kDefaultSpinUs = 200;
  void set_spin_us(int64_t us) { spin_us_.store(us < 0 ? 0 : us, std::memory_order_relaxed); }
  int64_t spin_us() const { return spin_us_.load(std::memory_order_relaxed); }

  template <class F>
  void parallel_for(int64_t n_tasks, int n_threads, F&& fn) {
    if (n_tasks <= 0) return;
    using Fn = std::remove_reference_t<F>;
    auto call = [](void* ctx, int64_t i) { (*static_cast<Fn*>(ctx))(i); };
    run(n_tasks, n_threads, call, const_cast<void*>(static_cast<const void*>(&fn)));
  }

 private:
  using Call = void (*)(void*, int64_t);
  void run(int64_t n_tasks, int n_threads, Call call, void* ctx);
  void ensure_workers(int n);  // n workers besides the caller
  void worker_loop(int id, uint64_t seen);  // id >= 1
  // Claim and run tasks of job `gen` until none is left; returns how many this thread ran.
  int64_t drain(uint32_t gen, int64_t n_tasks, Call call, void* ctx);

  std::mutex run_mu_;  // one parallel_for at a time (callers from several Python threads queue here)
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> gen_{0};
  // (job generation << 32) | next unclaimed task. The tag stops a worker that read an old job from
  // claiming a task of the next one with the old job's function.
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int64_t> spin_us_{kDefaultSpinUs};
  bool stop_ = false;
  // The job of generation gen_ (written under mu_ before gen_ is bumped).
  Call call_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_tasks_ = 0;
  int n_threads_ = 1;
};

}  // namespace ktq
