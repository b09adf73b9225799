// memcpy split over threads, for large host-to-host copies.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tc {

// Below this size a single memcpy wins over thread start-up.
constexpr size_t kParallelCopyMinBytes = 16ull << 20;

// dest and source must not overlap. threads: 0 = hardware concurrency.
void parallel_copy(uint8_t* dest, const uint8_t* source, size_t size_bytes, unsigned threads);

}  // namespace tc
