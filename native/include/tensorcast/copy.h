// memcpy split over threads, for large host-to-host copies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tensorcast/hash.h"

namespace tc {

// Below this size a single memcpy wins over thread start-up.
constexpr size_t kParallelCopyMinBytes = 16ull << 20;

// memcpy, but never slower than a plain vector loop (see copy.cpp). No overlap.
void copy_bytes(uint8_t* dest, const uint8_t* source, size_t size_bytes);

// dest and source must not overlap. threads: 0 = hardware concurrency.
void parallel_copy(uint8_t* dest, const uint8_t* source, size_t size_bytes, unsigned threads);

struct CopyJob {
    uint8_t* dest;
    const uint8_t* source;
    size_t size_bytes;
};

// Below this total, a batch of copies runs on the calling thread.
constexpr size_t kParallelCopyManyMinBytes = 2ull << 20;

// Many independent copies (e.g. a batch of KV pages), spread over threads by dynamic claiming.
// No dest may overlap any source or other dest.
void parallel_copy_many(const std::vector<CopyJob>& jobs, unsigned threads);

// parallel_copy_many that also returns each copy's tree hash (as tree_hash of its dest), computed
// piece by piece right after copying while the bytes are still in cache: a reader that must
// check what it copied pays little more than the copy.
std::vector<Digest> parallel_copy_hash_many(const std::vector<CopyJob>& jobs, unsigned threads);

}  // namespace tc
