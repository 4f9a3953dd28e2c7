// Why not at::parallel_for everywhere: its OpenMP team, when the caller is not the process's first
// thread (the server steps its engine in a thread of its own), wakes sleeping workers for every
// parallel section: a q4q8 matmul took 2x as long there as on the main thread (115 against 53 us).
// Workers here spin for a couple of milliseconds after each section (a decode step's sections are
// microseconds apart) and then sleep until the next one, so an idle server burns no core. On the
// first thread OpenMP's team is quick, and a second set of spinning workers beside its own would
// halve both (measured: 76 against 140 tok/s), so calls from there keep at::parallel_for.
// Either way each chunk's arithmetic is the same: results do not depend on the path.
#include "spin_pool.h"

#include <ATen/Parallel.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

class SpinPool {
 public:
  explicit SpinPool(int num_workers) {
    for (int i = 0; i < num_workers; ++i) workers_.emplace_back([this] { work(); });
  }

  ~SpinPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
  }

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  void run(int64_t num_chunks, const std::function<void(int64_t)>& chunk) {
    job_ = &chunk;
    num_chunks_ = num_chunks;
    next_.store(0);
    busy_.store(static_cast<int>(workers_.size()));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleeping_.load() > 0) wake_.notify_all();
    drain();
    while (busy_.load(std::memory_order_acquire) > 0) cpu_relax();
  }

 private:
  void drain() {
    for (int64_t i; (i = next_.fetch_add(1)) < num_chunks_;) (*job_)(i);
  }

  void work() {
    uint64_t seen = 0;  // the generation at construction: a run may start before this thread does
    while (true) {
      const auto spin_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(2);
      int64_t spins = 0;
      while (generation_.load(std::memory_order_acquire) == seen) {
        cpu_relax();
        if (++spins % 1024 == 0 && std::chrono::steady_clock::now() > spin_until) {
          std::unique_lock<std::mutex> lock(mutex_);
          sleeping_.fetch_add(1);
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          sleeping_.fetch_sub(1);
        }
      }
      seen = generation_.load(std::memory_order_acquire);
      if (stopping_) return;
      drain();
      busy_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> next_{0};
  std::atomic<int> busy_{0}, sleeping_{0};
  int64_t num_chunks_ = 0;
  const std::function<void(int64_t)>* job_ = nullptr;
  std::atomic<bool> stopping_{false};
};

std::mutex pool_mutex;  // one parallel section at a time; guards the pool's (re)creation
std::unique_ptr<SpinPool> pool;
pid_t pool_pid = 0;  // a forked child has the pool's object but none of its threads

thread_local bool serial = false;  // inside a SerialSection

}  // namespace

SerialSection::SerialSection() : before_(serial) { serial = true; }
SerialSection::~SerialSection() { serial = before_; }

void parallel_chunks(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& task) {
  if (n <= 0) return;
  if (serial) {
    task(0, n);
    return;
  }
  if (syscall(SYS_gettid) == getpid()) {  // the process's first thread: OpenMP's own team
    at::parallel_for(0, n, grain, task);
    return;
  }
  std::lock_guard<std::mutex> lock(pool_mutex);
  const int threads = std::max(1, at::get_num_threads());
  const int64_t num_chunks = std::min<int64_t>(threads, (n + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1));
  if (num_chunks <= 1) {
    task(0, n);
    return;
  }
  if (pool && pool_pid != getpid()) (void)pool.release();  // its threads are the parent's: leave them be
  if (!pool || pool->size() != threads) pool = std::make_unique<SpinPool>(threads - 1), pool_pid = getpid();
  const int64_t per_chunk = (n + num_chunks - 1) / num_chunks;
  pool->run(num_chunks, [&](int64_t i) { task(i * per_chunk, std::min(n, (i + 1) * per_chunk)); });
}
