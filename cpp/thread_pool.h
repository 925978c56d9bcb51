// A persistent worker pool shared by every operator (GEMV, KV-store attention).
//
// parallel_for(n_tasks, n_threads, fn) runs fn(i) for i in [0, n_tasks) on n_threads threads, the
// caller being thread 0. Thread j always gets the same contiguous range of tasks
// [j*n/nt, (j+1)*n/nt), so a kernel whose tasks write disjoint outputs (and reduce in a fixed order
// afterwards) gives the same bits for any thread count.
//
// Workers spin briefly (decode issues one call per layer and op, microseconds apart), then sleep on
// a condition variable so an idle runtime costs no CPU.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace ktq {

class ThreadPool {
 public:
  static ThreadPool& global();

  ThreadPool() = default;
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  template <class F>
  void parallel_for(int64_t n_tasks, int n_threads, F&& fn) {
    if (n_tasks <= 0) return;
    using Fn = std::remove_reference_t<F>;
    auto call = [](void* ctx, int64_t i) { (*static_cast<Fn*>(ctx))(i); };
    run(n_tasks, n_threads, call, const_cast<void*>(static_cast<const void*>(&fn)));
  }

  int n_workers() const { return static_cast<int>(workers_.size()); }

 private:
  using Call = void (*)(void*, int64_t);
  void run(int64_t n_tasks, int n_threads, Call call, void* ctx);
  void ensure_workers(int n);  // n workers besides the caller
  void worker_loop(int id, uint64_t seen);  // id >= 1
  static void run_range(int64_t n_tasks, int n_threads, int j, Call call, void* ctx);

  std::mutex run_mu_;  // one parallel_for at a time (callers from several Python threads queue here)
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> pending_{0};
  bool stop_ = false;
  // The job of generation gen_ (written before gen_ is bumped, read after it is seen).
  Call call_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_tasks_ = 0;
  int n_threads_ = 1;
};

}  // namespace ktq
