#include "tensorcast/arena.h"

#include <algorithm>
#include <string>

#include "tensorcast/errors.h"

namespace tc {

ArenaAllocator::ArenaAllocator(uint64_t capacity_bytes) : capacity_(capacity_bytes) {
    if (capacity_bytes % kArenaAlignment != 0)
        throw StatusError("InvalidArgument", "arena capacity must be a multiple of 4096 bytes");
    if (capacity_bytes > 0) free_[0] = capacity_bytes;
}

uint64_t ArenaAllocator::allocate(uint64_t size_bytes) {
    const uint64_t size = region_bytes(size_bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->second < size) continue;
        const uint64_t offset = it->first;
        const uint64_t left = it->second - size;
        free_.erase(it);
        if (left > 0) free_[offset + size] = left;
        used_[offset] = size;
        used_bytes_ += size;
        return offset;
    }
    throw StatusError(
        "ResourceExhausted",
        "pool full: need " + std::to_string(size) + " bytes, " +
            std::to_string(capacity_ - used_bytes_) + " free of " + std::to_string(capacity_) +
            " (largest free block " + std::to_string(largest_free_locked()) +
            "); delete artifacts or start the worker with a larger --mem");
}

void ArenaAllocator::free(uint64_t offset) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto used = used_.find(offset);
    if (used == used_.end())
        throw StatusError("InvalidArgument", "no allocated region at offset " + std::to_string(offset));
    uint64_t size = used->second;
    used_.erase(used);
    used_bytes_ -= size;
    // Coalesce with the neighbours so fragmentation does not accumulate.
    auto next = free_.lower_bound(offset);
    if (next != free_.end() && offset + size == next->first) {
        size += next->second;
        next = free_.erase(next);
    }
    if (next != free_.begin()) {
        auto prev = std::prev(next);
        if (prev->first + prev->second == offset) {
            prev->second += size;
            return;
        }
    }
    free_[offset] = size;
}

uint64_t ArenaAllocator::size_of(uint64_t offset) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = used_.find(offset);
    if (it == used_.end())
        throw StatusError("InvalidArgument", "no allocated region at offset " + std::to_string(offset));
    return it->second;
}

uint64_t ArenaAllocator::used_bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return used_bytes_;
}

uint64_t ArenaAllocator::largest_free_bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return largest_free_locked();
}

uint64_t ArenaAllocator::largest_free_locked() const {
    uint64_t largest = 0;
    for (const auto& [offset, size] : free_) largest = std::max(largest, size);
    return largest;
}

std::vector<std::pair<uint64_t, uint64_t>> ArenaAllocator::free_blocks() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return {free_.begin(), free_.end()};
}

}  // namespace tc
