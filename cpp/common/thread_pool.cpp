#include "common/thread_pool.h"

#include <algorithm>
#include <chrono>


namespace ktq {

namespace {
// How long an idle worker spins before sleeping (spin_us_, kDefaultSpinUs unless set). Decode calls come
// every few microseconds; a prompt's Python-side work between calls is longer, and sleeping then is fine.
constexpr int64_t kMaxThreads = 256;
}  // namespace

ThreadPool& ThreadPool::global() {
  // Leaked on purpose: joining threads during interpreter shutdown (static destruction) can deadlock.
  static ThreadPool* pool = new ThreadPool();
  return *pool;
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    gen_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::ensure_workers(int n) {
  while (static_cast<int>(workers_.size()) < n) {
    const int id = static_cast<int>(workers_.size()) + 1;
    // The generation is read here, not in the new thread: a thread that starts late must still
    // see the job published right after this call as new.
    const uint64_t seen = gen_.load(std::memory_order_acquire);
    workers_.emplace_back([this, id, seen] { worker_loop(id, seen); });
  }
}

int64_t ThreadPool::drain(uint32_t gen, int64_t n_tasks, Call call, void* ctx) {
  int64_t ran = 0;
  uint64_t c = claim_.load(std::memory_order_acquire);
  for (;;) {
    if (static_cast<uint32_t>(c >> 32) != gen) break;
    const int64_t i = static_cast<int64_t>(c & 0xffffffffu);
    if (i >= n_tasks) break;
    if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
    call(ctx, i);
    ++ran;
    c = claim_.load(std::memory_order_acquire);
  }
  if (ran) done_.fetch_add(ran, std::memory_order_acq_rel);
  return ran;
}

void ThreadPool::run(int64_t n_tasks, int n_threads, Call call, void* ctx) {
  // Never more threads than tasks, nor than kMaxThreads however many a caller asks for (the results do not
  // depend on the thread count; a pool of thousands of threads would only exhaust the process).
  n_threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({n_threads, n_tasks, kMaxThreads})));
  if (n_threads == 1) {
    for (int64_t i = 0; i < n_tasks; ++i) call(ctx, i);
    return;
  }
  std::lock_guard<std::mutex> run_lk(run_mu_);
  ensure_workers(n_threads - 1);
  uint32_t gen;
  {
    std::lock_guard<std::mutex> lk(mu_);  // pairs with the workers' predicate check: no lost wake-up
    call_ = call;
    ctx_ = ctx;
    n_tasks_ = n_tasks;
    n_threads_ = n_threads;
    done_.store(0, std::memory_order_relaxed);
    gen = static_cast<uint32_t>(gen_.load(std::memory_order_relaxed) + 1);
    claim_.store(static_cast<uint64_t>(gen) << 32, std::memory_order_release);
    gen_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();
  drain(gen, n_tasks, call, ctx);
  // Every task is claimed; wait for the ones still running on workers.
  // Yield after a short spin: on a busy host a worker may share this core, and must get to finish its task.
  for (int spins = 0; done_.load(std::memory_order_acquire) != n_tasks; ++spins) {
    if (spins < 64) cpu_pause();
    else std::this_thread::yield();
  }
}

void ThreadPool::worker_loop(int id, uint64_t seen) {
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    int spins = 0;
    while (gen_.load(std::memory_order_acquire) == seen) {
      if (spins % 16 == 15) std::this_thread::yield();  // never starve a thread that shares this core
      else cpu_pause();
      if (++spins % 256 == 0 &&
          std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(spin_us_.load(std::memory_order_relaxed))) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return gen_.load(std::memory_order_acquire) != seen; });
        break;
      }
    }
    Call call;
    void* ctx;
    int64_t n_tasks;
    int n_threads;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stop_) return;
      seen = gen_.load(std::memory_order_acquire);
      call = call_;
      ctx = ctx_;
      n_tasks = n_tasks_;
      n_threads = n_threads_;
    }
    if (id < n_threads) drain(static_cast<uint32_t>(seen), n_tasks, call, ctx);
  }
}

}  // namespace ktq
