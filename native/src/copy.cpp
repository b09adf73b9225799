#include "tensorcast/copy.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "parallel.h"

namespace tc {

void parallel_copy(uint8_t* dest, const uint8_t* source, size_t size_bytes, unsigned threads) {
    const unsigned workers =
        size_bytes < kParallelCopyMinBytes ? 1 : detail::resolve_threads(threads);
    const size_t part_bytes = (size_bytes + workers - 1) / workers;
    detail::run_workers(workers, [&](unsigned index) {
        const size_t begin = std::min(size_bytes, size_t(index) * part_bytes);
        const size_t end = std::min(size_bytes, begin + part_bytes);
        if (end > begin) std::memcpy(dest + begin, source + begin, end - begin);
    });
}

void parallel_copy_many(const std::vector<CopyJob>& jobs, unsigned threads) {
    if (jobs.size() == 1) {
        parallel_copy(jobs[0].dest, jobs[0].source, jobs[0].size_bytes, threads);
        return;
    }
    size_t total = 0;
    for (const CopyJob& j : jobs) total += j.size_bytes;
    const unsigned workers =
        total < kParallelCopyManyMinBytes
            ? 1
            : unsigned(std::min<size_t>(detail::resolve_threads(threads), jobs.size()));
    std::atomic<size_t> next{0};
    detail::run_workers(workers, [&](unsigned) {
        for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < jobs.size();) {
            if (jobs[i].size_bytes > 0)
                std::memcpy(jobs[i].dest, jobs[i].source, jobs[i].size_bytes);
        }
    });
}

}  // namespace tc
