#include "tensorcast/copy.h"

#include <algorithm>
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

}  // namespace tc
