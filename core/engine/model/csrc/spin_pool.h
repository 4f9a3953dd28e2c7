// The decode kernels' threads: a small pool whose workers spin between the ~150 parallel
// sections of a decode step instead of sleeping (see spin_pool.cpp).
#pragma once

#include <cstdint>
#include <functional>

// Run task(begin, end) over [0, n) split into chunks of at least `grain`, on the calling thread
// and the pool's workers (torch's thread count, at::get_num_threads(), in all); on the process's
// first thread, at::parallel_for (see spin_pool.cpp). Returns when
// every chunk is done. Calls from several threads at once take turns.
void parallel_chunks(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& task);

// While one is alive on a thread, parallel_chunks called from that thread runs the whole task
// there, at once: for work that is itself one chunk of a parallel section (a decode step split by
// rows, q4q8_decode.cpp), whose matmuls and attention must not start sections of their own.
class SerialSection {
 public:
  SerialSection();
  ~SerialSection();
  SerialSection(const SerialSection&) = delete;
  SerialSection& operator=(const SerialSection&) = delete;

 private:
  bool before_;
};
