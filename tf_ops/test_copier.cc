// DelayedTestCopier: the device copier's behaviour, on CPU, for tests.
//
// A GPU copy is issued on a stream and completes later, in issue order, on a
// thread that is not the kernel's. This copier does the same with one worker
// thread: each copy runs `delay` after it was issued, after every copy issued
// before it, and can be told to fail. Kernels registered with it under the
// label kAsyncTestLabel let tests on a CPU-only machine check what only a GPU
// would otherwise show: that outputs appear only after their copy finished,
// that buffers live until then, that failures become op errors, and that
// kernels never block a thread while a copy is in flight.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include "swap_common.h"

namespace sntf {
namespace {

using Clock = std::chrono::steady_clock;

struct TestCopierState {
  std::atomic<int64_t> delay_us{20000};
  std::atomic<int64_t> fail_next{0};  // copies still to fail, in issue order
  std::atomic<uint64_t> issued{0};
  std::atomic<uint64_t> completed{0};
  std::atomic<uint64_t> failed{0};
  std::atomic<int64_t> in_flight{0};
  std::atomic<int64_t> max_in_flight{0};
};

TestCopierState& State() {
  static TestCopierState* state = new TestCopierState();  // never destroyed
  return *state;
}

// One FIFO "stream" served by one detached worker thread (never joined: the
// process may exit with copies queued, as it may with a GPU stream busy).
class DelayedStream {
 public:
  static DelayedStream& Get() {
    static DelayedStream* stream = new DelayedStream();  // never destroyed
    return *stream;
  }

  void Enqueue(std::function<void()> job) {
    const auto due = Clock::now() + std::chrono::microseconds(
                                        State().delay_us.load());
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back({due, std::move(job)});
    ready_.notify_one();
  }

 private:
  struct Job {
    Clock::time_point due;
    std::function<void()> run;
  };

  DelayedStream() { std::thread([this] { Serve(); }).detach(); }

  void Serve() {
    for (;;) {
      Job job = Next();
      job.run();
    }
  }

  // The oldest job, once it is due; later jobs wait behind it.
  Job Next() {
    std::unique_lock<std::mutex> lock(mu_);
    ready_.wait(lock, [this] { return !jobs_.empty(); });
    while (Clock::now() < jobs_.front().due) {
      ready_.wait_until(lock, jobs_.front().due);
    }
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    return job;
  }

  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<Job> jobs_;
};

void NoteIssued() {
  TestCopierState& state = State();
  state.issued.fetch_add(1);
  const int64_t now = state.in_flight.fetch_add(1) + 1;
  int64_t seen = state.max_in_flight.load();
  while (now > seen && !state.max_in_flight.compare_exchange_weak(seen, now)) {
  }
}

// Decided at issue time, so "fail the next n" follows the issue order.
bool TakeFailure() {
  std::atomic<int64_t>& fail_next = State().fail_next;
  int64_t left = fail_next.load();
  while (left > 0 && !fail_next.compare_exchange_weak(left, left - 1)) {
  }
  return left > 0;
}

void Issue(tensorflow::Tensor from, tensorflow::Tensor to, Copier::Done done) {
  NoteIssued();
  const bool fail = TakeFailure();
  DelayedStream::Get().Enqueue([from = std::move(from), to = std::move(to),
                                done = std::move(done), fail]() mutable {
    TestCopierState& state = State();
    tensorflow::Status status = tensorflow::OkStatus();
    if (fail) {
      state.failed.fetch_add(1);
      status = tensorflow::errors::Internal(
          "sntf test copier: injected copy failure");
    } else {
      CopyBytes(from, &to);
    }
    // Let go of both buffers before `done`, which may run the kernel's
    // successors: a source held past it would overlap the next tensors.
    from = tensorflow::Tensor();
    to = tensorflow::Tensor();
    state.in_flight.fetch_sub(1);
    state.completed.fetch_add(1);
    done(status);
  });
}

}  // namespace

void DelayedTestCopier::ToHost(tensorflow::OpKernelContext*,
                               tensorflow::Tensor device,
                               tensorflow::Tensor host, Done done) const {
  Issue(std::move(device), std::move(host), std::move(done));
}

void DelayedTestCopier::ToDevice(tensorflow::OpKernelContext*,
                                 tensorflow::Tensor host,
                                 tensorflow::Tensor device, Done done) const {
  Issue(std::move(host), std::move(device), std::move(done));
}

}  // namespace sntf

extern "C" {

// Sets the delay of copies issued from now on, and how many of the next
// copies fail. Test-only.
__attribute__((visibility("default"))) void sntf_test_copier_configure(
    int64_t delay_us, int64_t fail_next) {
  sntf::State().delay_us = std::max<int64_t>(0, delay_us);
  sntf::State().fail_next = std::max<int64_t>(0, fail_next);
}

// out: issued, completed, failed, in flight now, most in flight at once.
__attribute__((visibility("default"))) int sntf_test_copier_stats(uint64_t* out,
                                                                  int n) {
  if (out == nullptr || n <= 0) return 0;
  const sntf::TestCopierState& s = sntf::State();
  const uint64_t values[] = {
      s.issued.load(), s.completed.load(), s.failed.load(),
      static_cast<uint64_t>(s.in_flight.load()),
      static_cast<uint64_t>(s.max_in_flight.load())};
  const int total = static_cast<int>(sizeof(values) / sizeof(values[0]));
  const int count = n < total ? n : total;
  for (int i = 0; i < count; ++i) out[i] = values[i];
  return count;
}

}  // extern "C"
