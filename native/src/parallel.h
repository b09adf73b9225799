// Internal: tiny std::thread helpers shared by the core sources.
#pragma once

#include <algorithm>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace tc::detail {

inline unsigned resolve_threads(unsigned threads) {
    if (threads != 0) return threads;
    // Cached: glibc answers by reading /sys on every call (~5 us).
    static const unsigned hardware = std::max(1u, std::thread::hardware_concurrency());
    return hardware;
}

// Runs work(worker_index) on `workers` workers, the calling thread being
// worker 0, so workers == 1 spawns nothing. Rethrows the first exception.
template <typename Work>
void run_workers(unsigned workers, const Work& work) {
    std::exception_ptr first_error;
    std::mutex error_mutex;
    auto guarded = [&](unsigned index) {
        try {
            work(index);
        } catch (...) {
            std::lock_guard<std::mutex> lock(error_mutex);
            if (!first_error) first_error = std::current_exception();
        }
    };
    std::vector<std::thread> pool;
    pool.reserve(workers - 1);
    for (unsigned i = 1; i < workers; ++i) pool.emplace_back(guarded, i);
    guarded(0);
    for (auto& t : pool) t.join();
    if (first_error) std::rethrow_exception(first_error);
}

}  // namespace tc::detail
