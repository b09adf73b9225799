// The KV pages a worker holds: many small keyed tensors in the pool, indexed here (not in the
// Global Store). One index per worker, used by its Python side (gRPC page service, hand-off,
// prefetch) and by the native page server for same-host callers, which never takes the GIL.
//
// A shard home holds the pages of the shards it leases (home = true); any worker may keep
// copies of pages homed elsewhere (home = false, token 0). Pages expire after their TTL unless
// read (a read renews the lease for the TTL it was put with) and are evicted least recently
// used when the pool is full. Readers copy straight out of the pool and check the page hash,
// so a region evicted and reused during a copy is detected.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tensorcast/arena.h"
#include "tensorcast/page.h"
#include "tensorcast/page_directory.h"

namespace tc {

constexpr uint64_t kMaxPageBytes = 64ull << 20;
constexpr size_t kMaxPageBatch = 4096;
constexpr size_t kMaxPageKeyBytes = 512;
constexpr double kMaxPageTtlS = 7 * 24 * 3600.0;

struct PageKey {
    std::string key;
    uint32_t shard = 0;
    uint64_t token = 0;  // 0: any copy; else the page must be homed here under `shard`
};

struct CommitOptions {
    bool home = true;  // homed here under its shard's lease; else a cached copy (token 0)
    bool if_absent = false;  // a live home page already under a key stays (the new copy is freed)
    // Hash every region and refuse a page whose bytes do not match the writer's claim. Off only
    // for a writer that hashed the bytes as it wrote them into the pool (same-host page puts).
    bool check_hashes = true;
    // > 0: the first lease runs this long, at most ttl_s (a page copied to a new home keeps
    // what it had left); reads still renew it for ttl_s.
    double expires_in_s = 0;
};

struct PageIndexStats {
    uint64_t pages = 0;
    uint64_t home_pages = 0;
    uint64_t bytes = 0;         // the pages' own sizes
    uint64_t region_bytes = 0;  // the pool they take (regions are page aligned)
};

// Called (without the index lock) when a page operation names a lease this index does not hold
// under exactly that token; it may refresh the worker's lease table and push it here. Throws
// StatusError("FencingError") to refuse.
using LeaseFallback = std::function<void(const std::vector<std::pair<uint32_t, uint64_t>>&)>;

class PageIndex {
public:
    // `base` is the pool's memory (the arena the allocator hands out), `itemsizes` the dtype
    // names pages may carry and their element sizes.
    PageIndex(uint8_t* base, std::shared_ptr<ArenaAllocator> arena,
              std::map<std::string, uint64_t> itemsizes);

    // -- writing --
    // Regions for a batch of pages; evicts least recently used pages to make room (unless
    // `evict` is false: then a full pool is ResourceExhausted). All or nothing.
    std::vector<uint64_t> allocate(const std::vector<uint64_t>& sizes, bool evict);
    void free(const std::vector<uint64_t>& offsets);
    // Index written pages after checking them (and, unless told not to, their hashes). All or
    // nothing: on any error every region of the batch is freed and the index is unchanged.
    void commit(const std::vector<PageWrite>& writes, double ttl_s, CommitOptions options);

    // -- reading --
    // The live pages under `keys`. `read`: the caller copies them, so each one's lease runs
    // at least its ttl_s from now; a lookup alone (an exists) renews nothing.
    std::vector<std::optional<Page>> lookup(const std::vector<PageKey>& keys, bool read = false);
    uint8_t* base() const { return base_; }
    // Mirror the index (and the leases) into `directory` from now on, for same-host readers.
    // Call before the first page is committed.
    void attach_directory(std::shared_ptr<PageDirectory> directory);

    // -- leases (the worker's view, pushed by its lease cache) --
    void set_leases(const std::map<uint32_t, std::pair<uint64_t, double>>& held);
    void set_lease_fallback(LeaseFallback fallback);
    // Throws StatusError("FencingError") unless this worker homes every (shard, token).
    void check_leases(const std::vector<std::pair<uint32_t, uint64_t>>& shard_tokens);

    // -- lifecycle --
    std::vector<Page> home_pages(uint32_t shard, uint64_t max_token);  // soonest expiry first
    size_t drop_shards(const std::set<uint32_t>& shards, std::optional<uint64_t> max_token);
    size_t expire();
    PageIndexStats stats();

private:
    struct Entry {
        Page page;
        std::list<std::string>::iterator lru;
        std::multimap<double, std::string>::iterator expiry;
        int64_t slot = -1;  // in the directory, or -1
    };
    void check_write(const PageWrite& w) const;
    uint64_t allocate_one(uint64_t size, bool evict);
    bool fits_after_eviction(uint64_t size);
    bool evict_one();
    bool live_locked(Entry& entry, double now);
    void renew_locked(Entry& entry, double now);
    void remove_locked(std::unordered_map<std::string, Entry>::iterator it);

    uint8_t* const base_;
    const std::shared_ptr<ArenaAllocator> arena_;
    const std::map<std::string, uint64_t> itemsizes_;
    std::mutex mutex_;
    std::unordered_map<std::string, Entry> pages_;
    std::list<std::string> lru_;  // front: least recently used
    // Soonest expiry first: expire() (every heartbeat) touches only what expired, never the
    // whole index under the lock page operations wait on.
    std::multimap<double, std::string> expiry_;
    uint64_t bytes_ = 0;
    uint64_t region_bytes_ = 0;
    uint64_t home_count_ = 0;
    std::mutex lease_mutex_;
    std::map<uint32_t, std::pair<uint64_t, double>> held_;  // shard -> (token, local deadline)
    LeaseFallback fallback_;
    std::shared_ptr<PageDirectory> directory_;  // set once, before use
};

}  // namespace tc
