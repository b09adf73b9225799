// First-fit allocator over a fixed arena of bytes: pure bookkeeping, no memory is touched.
// Thread-safe: the worker's pool (Python) and its page index (C++, no GIL) share one arena.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace tc {

constexpr uint64_t kArenaAlignment = 4096;  // offsets are page aligned: any region can be mapped

// Bytes of arena a region of `size_bytes` takes (an empty region takes one page).
constexpr uint64_t region_bytes(uint64_t size_bytes) {
    return ((size_bytes ? size_bytes : 1) + kArenaAlignment - 1) / kArenaAlignment *
           kArenaAlignment;
}

class ArenaAllocator {
public:
    explicit ArenaAllocator(uint64_t capacity_bytes);

    // Offset of a new region of at least `size_bytes` (an empty region takes one page).
    // Throws StatusError("ResourceExhausted") when no free block is large enough.
    uint64_t allocate(uint64_t size_bytes);
    // Throws StatusError("InvalidArgument") for an offset that is not allocated.
    void free(uint64_t offset);
    uint64_t size_of(uint64_t offset) const;

    uint64_t capacity_bytes() const { return capacity_; }
    uint64_t used_bytes() const;
    uint64_t largest_free_bytes() const;
    std::vector<std::pair<uint64_t, uint64_t>> free_blocks() const;  // (offset, size), sorted

private:
    uint64_t largest_free_locked() const;

    const uint64_t capacity_;
    mutable std::mutex mutex_;
    std::map<uint64_t, uint64_t> free_;  // offset -> size, never adjacent (coalesced)
    std::map<uint64_t, uint64_t> used_;  // offset -> size
    uint64_t used_bytes_ = 0;
};

}  // namespace tc
