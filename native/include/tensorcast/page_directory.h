// A mirror of a worker's page index in shared memory, so that same-host callers find a page
// without a round trip to the worker (and without waking one of its threads).
//
// The worker is the only writer (under its index lock); every slot and every shard lease is
// guarded by a sequence lock, so a reader sees a whole entry or retries. The index stays the
// truth: a page the directory lacks (table full, more than kDirectoryMaxDims dimensions, a
// shard beyond kDirectoryShards) or a lease it does not show is looked up over the page socket
// as before. Readers copy page bytes out of the pool and check their hash, as on every read,
// so a region evicted and reused meanwhile is detected. Readers map the entries read-only; the
// one thing they write is a "touched" byte per slot, so that uses that never reach the worker
// still count: every lookup sets kTouchUsed, which LRU eviction takes as a second chance; a
// lookup for a read (not an exists) also sets kTouchRead, which expiry takes as a reason to
// renew the page's lease. Each has its own consumer, so neither takes the other's signal.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tensorcast/page.h"

namespace tc {

constexpr uint64_t kDirectoryMagic = 0x3152494447504354ull;  // "TCPGDIR1"
constexpr uint32_t kDirectoryProbes = 16;     // slots an insert or a lookup looks at
constexpr size_t kDirectoryMaxDims = 6;
constexpr uint32_t kDirectoryShards = 4096;   // leases published for shards below this
constexpr size_t kDirectoryDtypeBytes = 8;    // dtype names up to 7 characters
// Bits of a slot's touched byte (a reader of an earlier version stores kTouchUsed alone).
constexpr uint8_t kTouchUsed = 1;  // looked up since LRU eviction last looked
constexpr uint8_t kTouchRead = 2;  // read since expiry last looked

// The worker's side: owns the shared memory (a memfd handed to callers).
class PageDirectory {
public:
    explicit PageDirectory(uint32_t min_slots);  // rounded up to a power of two
    ~PageDirectory();
    PageDirectory(const PageDirectory&) = delete;
    PageDirectory& operator=(const PageDirectory&) = delete;

    int fd() const { return fd_; }
    uint64_t size_bytes() const { return size_bytes_; }
    uint64_t touch_offset() const;  // page aligned: [touch_offset, size_bytes) is writable
    uint32_t slots() const;

    // The slot now describing the page, or -1 when it cannot be published (the socket
    // serves it).
    int64_t publish(const Page& page);
    void unpublish(int64_t slot);
    void set_expiry(int64_t slot, double expires_at);  // a renewed lease
    // shard -> (token, monotonic deadline), as the worker's lease table holds them.
    void set_leases(const std::map<uint32_t, std::pair<uint64_t, double>>& held);
    // Whether a reader set `bit` (kTouchUsed or kTouchRead) on the slot since the last call
    // for that bit (and forget that it did; the other bit stays).
    bool take_touched(int64_t slot, uint8_t bit);

private:
    int fd_ = -1;
    uint64_t size_bytes_ = 0;
    uint8_t* base_ = nullptr;
    std::map<uint32_t, uint64_t> published_shards_;  // shards with a lease shown now
};

// A caller's side: maps a worker's directory from its descriptor (which it may close after).
class DirectoryReader {
public:
    struct Hit {
        uint64_t offset;
        uint64_t size_bytes;
        std::string dtype;
        std::vector<int64_t> shape;
        std::string hash;
    };

    DirectoryReader(int fd, uint64_t size_bytes);
    ~DirectoryReader();
    DirectoryReader(const DirectoryReader&) = delete;
    DirectoryReader& operator=(const DirectoryReader&) = delete;

    // A live page under key (token 0: any copy; else homed here under shard with that lease
    // held now), or nothing: then ask the worker. `read`: the caller copies the page (this
    // renews its lease when it reaches its expiry); an exists is not a read.
    std::optional<Hit> lookup(const std::string& key, uint32_t shard, uint64_t token,
                              bool read = false) const;

private:
    uint8_t* entries_ = nullptr;  // read-only
    uint8_t* touched_ = nullptr;  // writable
    uint64_t entries_bytes_ = 0;
    uint64_t touched_bytes_ = 0;
    uint32_t slot_mask_ = 0;
};

}  // namespace tc
