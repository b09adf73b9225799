#include "tensorcast/page_index.h"

#include <time.h>

#include <algorithm>

#include "tensorcast/errors.h"
#include "tensorcast/hash.h"

namespace tc {
namespace {

std::string quoted(const std::string& key) { return "'" + key.substr(0, 80) + "'"; }

}  // namespace

double monotonic_s() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

PageIndex::PageIndex(uint8_t* base, std::shared_ptr<ArenaAllocator> arena,
                     std::map<std::string, uint64_t> itemsizes)
    : base_(base), arena_(std::move(arena)), itemsizes_(std::move(itemsizes)) {}

// -- writing -----------------------------------------------------------------------------------

std::vector<uint64_t> PageIndex::allocate(const std::vector<uint64_t>& sizes, bool evict) {
    if (sizes.size() > kMaxPageBatch)
        throw StatusError("InvalidArgument", "batch of " + std::to_string(sizes.size()) +
                                                 " pages, the limit is " +
                                                 std::to_string(kMaxPageBatch));
    std::vector<uint64_t> offsets;
    offsets.reserve(sizes.size());
    try {
        for (uint64_t size : sizes) {
            if (size > kMaxPageBytes)
                throw StatusError("InvalidArgument", "page of " + std::to_string(size) +
                                                         " bytes, the limit is " +
                                                         std::to_string(kMaxPageBytes));
            offsets.push_back(allocate_one(size, evict));
        }
    } catch (...) {
        free(offsets);
        throw;
    }
    return offsets;
}

uint64_t PageIndex::allocate_one(uint64_t size, bool evict) {
    while (true) {
        try {
            return arena_->allocate(size);
        } catch (const StatusError& e) {
            if (!evict || e.kind != "ResourceExhausted" || !fits_after_eviction(size) ||
                !evict_one())
                throw;
        }
    }
}

bool PageIndex::fits_after_eviction(uint64_t size) {
    // What pages do not hold (artifacts, regions still being written) stays whatever is
    // evicted: when even an arena without pages has no room, evicting would only lose pages.
    std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t used = arena_->used_bytes();
    const uint64_t kept = used - std::min(used, region_bytes_);
    return kept + region_bytes(size) <= arena_->capacity_bytes();
}

bool PageIndex::evict_one() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (lru_.empty()) return false;
    // Pages read through the directory never told the index: their touch gives them a second
    // chance (bounded, so eviction never loops over a pool of hot pages). Eviction takes only
    // the "used" bit: the "read" bit stays for expiry (live_locked), which a second chance
    // here must not cost a page that is still being read.
    for (int chance = 0; directory_ && chance < 64; ++chance) {
        const Entry& lru = pages_.find(lru_.front())->second;
        if (!directory_->take_touched(lru.slot, kTouchUsed)) break;
        lru_.splice(lru_.end(), lru_, lru.lru);
    }
    remove_locked(pages_.find(lru_.front()));
    return true;
}

void PageIndex::free(const std::vector<uint64_t>& offsets) {
    for (uint64_t offset : offsets) arena_->free(offset);
}

void PageIndex::check_write(const PageWrite& w) const {
    const bool printable = std::all_of(w.key.begin(), w.key.end(), [](char c) {
        return static_cast<unsigned char>(c) >= 0x20 && c != 0x7f;
    });
    if (w.key.empty() || w.key.size() > kMaxPageKeyBytes || !printable)
        throw StatusError("InvalidArgument", "bad page key " + quoted(w.key) + ": 1-" +
                                                 std::to_string(kMaxPageKeyBytes) +
                                                 " printable chars");
    auto itemsize = itemsizes_.find(w.dtype);
    uint64_t elements = 1;
    bool bad_shape = false;
    for (int64_t d : w.shape) {
        if (d < 0 || (d > 0 && elements > kMaxPageBytes / uint64_t(d))) bad_shape = true;
        else elements *= uint64_t(d);
    }
    if (itemsize == itemsizes_.end() || bad_shape)
        throw StatusError("InvalidArgument", "page " + quoted(w.key) + ": bad dtype '" +
                                                 w.dtype.substr(0, 40) + "' or shape");
    if (elements * itemsize->second != w.size_bytes)
        throw StatusError("InvalidArgument", "page " + quoted(w.key) + ": " +
                                                 std::to_string(w.size_bytes) +
                                                 " bytes do not match its dtype and shape");
    if (w.size_bytes > kMaxPageBytes)
        throw StatusError("InvalidArgument", "page " + quoted(w.key) + ": " +
                                                 std::to_string(w.size_bytes) +
                                                 " bytes, the limit is " +
                                                 std::to_string(kMaxPageBytes));
    const bool hex_digest =
        w.hash.size() == 2 * sizeof(Digest) &&
        std::all_of(w.hash.begin(), w.hash.end(),
                    [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
    if (!hex_digest)
        throw StatusError("InvalidArgument", "page " + quoted(w.key) + ": the hash is not " +
                                                 std::to_string(2 * sizeof(Digest)) +
                                                 " lowercase hex digits");
    const uint64_t region = arena_->size_of(w.offset);  // throws for a region not allocated
    if (w.size_bytes > region)
        throw StatusError("InvalidArgument", "page " + quoted(w.key) + " is larger than its region");
}

void PageIndex::commit(const std::vector<PageWrite>& writes, double ttl_s,
                       CommitOptions options) {
    const bool home = options.home, if_absent = options.if_absent;
    std::vector<uint64_t> offsets;
    for (const auto& w : writes) offsets.push_back(w.offset);
    try {
        if (!(ttl_s > 0 && ttl_s <= kMaxPageTtlS))
            throw StatusError("InvalidArgument", "page ttl_s must be in (0, " +
                                                     std::to_string(int64_t(kMaxPageTtlS)) +
                                                     "], not " + std::to_string(ttl_s));
        if (!(options.expires_in_s >= 0 && options.expires_in_s <= ttl_s))
            throw StatusError("InvalidArgument", "page expires_in_s must be in [0, ttl_s], not " +
                                                     std::to_string(options.expires_in_s));
        for (const auto& w : writes) check_write(w);
        std::vector<std::pair<const uint8_t*, size_t>> regions;
        if (options.check_hashes)
            for (const auto& w : writes) regions.emplace_back(base_ + w.offset, w.size_bytes);
        const auto digests = tree_hash_many(regions, 0);
        for (size_t i = 0; i < digests.size(); ++i) {
            const std::string got = hex(digests[i]);
            if (got != writes[i].hash)
                throw StatusError("IntegrityError",
                                  "page " + quoted(writes[i].key) + ": bytes hash to " + got +
                                      ", the writer claimed " + writes[i].hash.substr(0, 64) +
                                      "; nothing was stored");
        }
    } catch (...) {
        for (uint64_t offset : offsets) {
            try {
                arena_->free(offset);
            } catch (const StatusError&) {  // not an allocated region: nothing to give back
            }
        }
        throw;
    }
    const double now = monotonic_s();
    std::vector<uint64_t> unused;  // freed after the lock: the arena has its own
    {
        std::lock_guard<std::mutex> lock(mutex_);
        for (const auto& w : writes) {
            auto old = pages_.find(w.key);
            if (if_absent && old != pages_.end() && old->second.page.home &&
                live_locked(old->second, now)) {
                unused.push_back(w.offset);
                continue;
            }
            if (old != pages_.end()) remove_locked(old);
            Page page;
            static_cast<PageWrite&>(page) = w;
            if (!home) page.token = 0;
            page.expires_at = now + (options.expires_in_s > 0 ? options.expires_in_s : ttl_s);
            page.ttl_s = ttl_s;
            page.home = home;
            lru_.push_back(w.key);
            const auto expiry = expiry_.emplace(page.expires_at, w.key);
            const int64_t slot = directory_ ? directory_->publish(page) : -1;
            pages_.emplace(w.key, Entry{std::move(page), std::prev(lru_.end()), expiry, slot});
            bytes_ += w.size_bytes;
            region_bytes_ += region_bytes(w.size_bytes);
            home_count_ += home;
        }
    }
    free(unused);
}

// -- reading -----------------------------------------------------------------------------------

std::vector<std::optional<Page>> PageIndex::lookup(const std::vector<PageKey>& keys, bool read) {
    if (keys.size() > kMaxPageBatch)
        throw StatusError("InvalidArgument", "batch of " + std::to_string(keys.size()) +
                                                 " keys, the limit is " +
                                                 std::to_string(kMaxPageBatch));
    const double now = monotonic_s();
    std::vector<std::optional<Page>> found;
    found.reserve(keys.size());
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& k : keys) {
        auto it = pages_.find(k.key);
        if (it == pages_.end() ||
            (k.token != 0 && (!it->second.page.home || it->second.page.shard != k.shard)) ||
            !live_locked(it->second, now)) {
            found.emplace_back();
            continue;
        }
        if (read) renew_locked(it->second, now);
        lru_.splice(lru_.end(), lru_, it->second.lru);
        found.emplace_back(it->second.page);
    }
    return found;
}

// Whether a page is live at `now`. One at its expiry that was read through the directory since
// expiry last looked (such reads never reach the index) gets a new lease instead: every place
// that finds a page expired (lookups, the sweep, if_absent, hand-off) asks here, so none of
// them drops a page that another would have renewed. Only expiry takes the "read" bit.
bool PageIndex::live_locked(Entry& entry, double now) {
    if (entry.page.expires_at > now) return true;
    if (!directory_ || !directory_->take_touched(entry.slot, kTouchRead)) return false;
    renew_locked(entry, now);
    return true;
}

// The page was read at `now`: its lease runs at least its ttl_s from now.
void PageIndex::renew_locked(Entry& entry, double now) {
    const double expires_at = now + entry.page.ttl_s;
    if (expires_at <= entry.page.expires_at) return;
    entry.page.expires_at = expires_at;
    auto node = expiry_.extract(entry.expiry);
    node.key() = expires_at;
    entry.expiry = expiry_.insert(std::move(node));
    if (directory_) directory_->set_expiry(entry.slot, expires_at);  // its readers follow
}

// -- leases ------------------------------------------------------------------------------------

void PageIndex::set_leases(const std::map<uint32_t, std::pair<uint64_t, double>>& held) {
    std::lock_guard<std::mutex> lock(lease_mutex_);
    held_ = held;
    if (directory_) directory_->set_leases(held);
}

void PageIndex::attach_directory(std::shared_ptr<PageDirectory> directory) {
    std::scoped_lock lock(mutex_, lease_mutex_);
    directory_ = std::move(directory);
    directory_->set_leases(held_);
}

void PageIndex::set_lease_fallback(LeaseFallback fallback) {
    std::lock_guard<std::mutex> lock(lease_mutex_);
    fallback_ = std::move(fallback);
}

void PageIndex::check_leases(const std::vector<std::pair<uint32_t, uint64_t>>& shard_tokens) {
    LeaseFallback fallback;
    {
        const double now = monotonic_s();
        std::lock_guard<std::mutex> lock(lease_mutex_);
        bool all_held = true;
        for (const auto& [shard, token] : shard_tokens) {
            auto it = held_.find(shard);
            if (it == held_.end() || it->second.first != token || it->second.second <= now) {
                all_held = false;
                break;
            }
        }
        if (all_held) return;
        fallback = fallback_;
    }
    // Not held as named: the worker's own rules decide (a newer token may mean a lease just
    // moved here, learned from the Global Store on demand).
    if (!fallback) throw StatusError("FencingError", "this worker does not hold the named leases");
    fallback(shard_tokens);
}

// -- lifecycle ---------------------------------------------------------------------------------

std::vector<Page> PageIndex::home_pages(uint32_t shard, uint64_t max_token) {
    const double now = monotonic_s();
    std::vector<Page> out;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto& [key, entry] : pages_) {
            const Page& p = entry.page;
            if (p.home && p.shard == shard && p.token <= max_token && live_locked(entry, now))
                out.push_back(p);
        }
    }
    std::sort(out.begin(), out.end(),
              [](const Page& a, const Page& b) { return a.expires_at < b.expires_at; });
    return out;
}

size_t PageIndex::drop_shards(const std::set<uint32_t>& shards, std::optional<uint64_t> max_token) {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t dropped = 0;
    for (auto it = pages_.begin(); it != pages_.end();) {
        const Page& p = it->second.page;
        auto next = std::next(it);
        if (p.home && shards.count(p.shard) && (!max_token || p.token <= *max_token)) {
            remove_locked(it);
            ++dropped;
        }
        it = next;
    }
    return dropped;
}

size_t PageIndex::expire() {
    const double now = monotonic_s();
    std::lock_guard<std::mutex> lock(mutex_);
    size_t expired = 0;
    while (!expiry_.empty() && expiry_.begin()->first <= now) {
        auto it = pages_.find(expiry_.begin()->second);
        if (live_locked(it->second, now)) continue;  // renewed: its entry moved past `now`
        remove_locked(it);
        ++expired;
    }
    return expired;
}

PageIndexStats PageIndex::stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    PageIndexStats s;
    s.pages = pages_.size();
    s.bytes = bytes_;
    s.region_bytes = region_bytes_;
    s.home_pages = home_count_;
    return s;
}

void PageIndex::remove_locked(std::unordered_map<std::string, Entry>::iterator it) {
    bytes_ -= it->second.page.size_bytes;
    region_bytes_ -= region_bytes(it->second.page.size_bytes);
    home_count_ -= it->second.page.home;
    if (directory_) directory_->unpublish(it->second.slot);  // before its region can be reused
    arena_->free(it->second.page.offset);
    lru_.erase(it->second.lru);
    expiry_.erase(it->second.expiry);
    pages_.erase(it);
}

}  // namespace tc
