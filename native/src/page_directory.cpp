#include "tensorcast/page_directory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "tensorcast/errors.h"
#include "tensorcast/hash.h"
#include "xxh.h"

namespace tc {
namespace {

constexpr uint64_t kPage = 4096;
constexpr int kReadAttempts = 4;  // a slot rewritten this often while read: ask the worker

struct Header {
    uint64_t magic;
    uint32_t slots;
    uint32_t shards;
    uint64_t shards_offset;
    uint64_t slots_offset;
    uint64_t touch_offset;
    uint64_t size_bytes;
};

struct ShardLease {
    uint64_t seq;  // odd while written
    uint64_t token;
    double deadline;
    uint64_t unused;
};

enum : uint8_t { kEmpty = 0, kLive = 1, kRemoved = 2 };  // empty: never used since creation

struct Slot {
    uint64_t seq;  // odd while written
    uint8_t state;
    uint8_t home;
    uint8_t ndim;
    uint8_t unused;
    uint32_t shard;
    uint64_t key_lo, key_hi;  // XXH3-128 of the key
    uint64_t offset, size_bytes;
    double expires_at;
    uint8_t hash[16];
    char dtype[kDirectoryDtypeBytes];
    int64_t shape[kDirectoryMaxDims];
};
static_assert(sizeof(Slot) == 128, "a slot is two cache lines");

uint64_t align_page(uint64_t x) { return (x + kPage - 1) / kPage * kPage; }

XXH128_hash_t key_hash(const std::string& key) { return xxh::hash128(key.data(), key.size()); }

bool parse_hex(const std::string& hex, uint8_t out[16]) {
    if (hex.size() != 32) return false;
    for (size_t i = 0; i < 16; ++i) {
        int v = 0;
        for (char c : {hex[2 * i], hex[2 * i + 1]}) {
            v <<= 4;
            if (c >= '0' && c <= '9') v |= c - '0';
            else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
            else return false;
        }
        out[i] = uint8_t(v);
    }
    return true;
}

// Sequence-locked writes (one writer) and reads (any number, any process).
template <typename T, typename Fill>
void write_locked(T* entry, const Fill& fill) {
    const uint64_t seq = entry->seq;
    __atomic_store_n(&entry->seq, seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    fill(*entry);
    __atomic_store_n(&entry->seq, seq + 2, __ATOMIC_RELEASE);
}

template <typename T>
bool read_locked(const T* entry, T& out) {
    for (int attempt = 0; attempt < kReadAttempts; ++attempt) {
        const uint64_t before = __atomic_load_n(&entry->seq, __ATOMIC_ACQUIRE);
        if (before & 1) continue;
        std::memcpy(static_cast<void*>(&out), entry, sizeof(T));
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&entry->seq, __ATOMIC_RELAXED) == before) return true;
    }
    return false;
}

uint32_t power_of_two_at_least(uint32_t n) {
    uint32_t p = 1024;
    while (p < n && p < (1u << 30)) p <<= 1;
    return p;
}

}  // namespace

PageDirectory::PageDirectory(uint32_t min_slots) {
    const uint32_t slots = power_of_two_at_least(min_slots);
    Header header{};
    header.magic = kDirectoryMagic;
    header.slots = slots;
    header.shards = kDirectoryShards;
    header.shards_offset = kPage;
    header.slots_offset = align_page(header.shards_offset + kDirectoryShards * sizeof(ShardLease));
    header.touch_offset = align_page(header.slots_offset + uint64_t(slots) * sizeof(Slot));
    header.size_bytes = align_page(header.touch_offset + slots);
    size_bytes_ = header.size_bytes;
    fd_ = ::memfd_create("tensorcast-page-directory", MFD_CLOEXEC);
    if (fd_ < 0) throw IoError(std::string("memfd_create failed: ") + std::strerror(errno));
    void* mapped = MAP_FAILED;
    if (::ftruncate(fd_, off_t(size_bytes_)) == 0)
        mapped = ::mmap(nullptr, size_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (mapped == MAP_FAILED) {
        const int error = errno;
        ::close(fd_);
        throw IoError(std::string("page directory mapping failed: ") + std::strerror(error));
    }
    base_ = static_cast<uint8_t*>(mapped);
    std::memcpy(base_, &header, sizeof(header));  // the rest is zero: empty slots, no leases
}

PageDirectory::~PageDirectory() {
    ::munmap(base_, size_bytes_);
    ::close(fd_);
}

uint64_t PageDirectory::touch_offset() const {
    return reinterpret_cast<const Header*>(base_)->touch_offset;
}

uint32_t PageDirectory::slots() const { return reinterpret_cast<const Header*>(base_)->slots; }

int64_t PageDirectory::publish(const Page& page) {
    uint8_t hash[16];
    if (page.shape.size() > kDirectoryMaxDims || page.dtype.size() >= kDirectoryDtypeBytes ||
        !parse_hex(page.hash, hash))
        return -1;
    const Header& header = *reinterpret_cast<const Header*>(base_);
    Slot* slots = reinterpret_cast<Slot*>(base_ + header.slots_offset);
    const XXH128_hash_t h = key_hash(page.key);
    const uint32_t mask = header.slots - 1;
    for (uint32_t probe = 0; probe < kDirectoryProbes; ++probe) {
        const uint32_t index = uint32_t(h.low64 + probe) & mask;
        Slot* slot = &slots[index];
        if (slot->state == kLive) continue;  // the index unpublishes a key before its next page
        write_locked(slot, [&](Slot& s) {
            s.state = kLive;
            s.home = page.home;
            s.ndim = uint8_t(page.shape.size());
            s.shard = page.shard;
            s.key_lo = h.low64;
            s.key_hi = h.high64;
            s.offset = page.offset;
            s.size_bytes = page.size_bytes;
            s.expires_at = page.expires_at;
            std::memcpy(s.hash, hash, 16);
            std::memset(s.dtype, 0, sizeof(s.dtype));
            std::memcpy(s.dtype, page.dtype.data(), page.dtype.size());
            std::memset(s.shape, 0, sizeof(s.shape));
            std::copy(page.shape.begin(), page.shape.end(), s.shape);
        });
        __atomic_store_n(base_ + header.touch_offset + index, uint8_t(0), __ATOMIC_RELAXED);
        return index;
    }
    return -1;  // a crowded neighbourhood: this page is served over the socket only
}

void PageDirectory::unpublish(int64_t slot) {
    if (slot < 0) return;
    const Header& header = *reinterpret_cast<const Header*>(base_);
    Slot* s = reinterpret_cast<Slot*>(base_ + header.slots_offset) + slot;
    write_locked(s, [](Slot& entry) { entry.state = kRemoved; });
}

void PageDirectory::set_expiry(int64_t slot, double expires_at) {
    if (slot < 0) return;
    const Header& header = *reinterpret_cast<const Header*>(base_);
    Slot* s = reinterpret_cast<Slot*>(base_ + header.slots_offset) + slot;
    write_locked(s, [&](Slot& entry) { entry.expires_at = expires_at; });
}

void PageDirectory::set_leases(const std::map<uint32_t, std::pair<uint64_t, double>>& held) {
    const Header& header = *reinterpret_cast<const Header*>(base_);
    ShardLease* leases = reinterpret_cast<ShardLease*>(base_ + header.shards_offset);
    auto show = [&](uint32_t shard, uint64_t token, double deadline) {
        write_locked(&leases[shard], [&](ShardLease& l) {
            l.token = token;
            l.deadline = deadline;
        });
    };
    for (auto it = published_shards_.begin(); it != published_shards_.end();) {
        if (held.count(it->first) == 0) {
            show(it->first, 0, 0);  // no longer held: readers ask the worker
            it = published_shards_.erase(it);
        } else {
            ++it;
        }
    }
    for (const auto& [shard, lease] : held) {
        if (shard >= kDirectoryShards) continue;
        show(shard, lease.first, lease.second);
        published_shards_[shard] = lease.first;
    }
}

bool PageDirectory::take_touched(int64_t slot, uint8_t bit) {
    if (slot < 0) return false;
    const Header& header = *reinterpret_cast<const Header*>(base_);
    uint8_t* touched = base_ + header.touch_offset + slot;
    if ((__atomic_load_n(touched, __ATOMIC_RELAXED) & bit) == 0) return false;
    return (__atomic_fetch_and(touched, uint8_t(~bit), __ATOMIC_RELAXED) & bit) != 0;
}

DirectoryReader::DirectoryReader(int fd, uint64_t size_bytes) {
    Header header{};
    if (size_bytes < kPage || ::pread(fd, &header, sizeof(header), 0) != ssize_t(sizeof(header)) ||
        header.magic != kDirectoryMagic || header.size_bytes != size_bytes || header.slots == 0 ||
        (header.slots & (header.slots - 1)) != 0 || header.touch_offset % kPage != 0 ||
        header.slots_offset + uint64_t(header.slots) * sizeof(Slot) > header.touch_offset ||
        header.shards_offset + uint64_t(header.shards) * sizeof(ShardLease) > header.slots_offset ||
        header.touch_offset + header.slots > size_bytes)
        throw IoError("not a page directory (or one of another version)");
    entries_bytes_ = header.touch_offset;
    touched_bytes_ = size_bytes - header.touch_offset;
    void* entries = ::mmap(nullptr, entries_bytes_, PROT_READ, MAP_SHARED, fd, 0);
    if (entries == MAP_FAILED)
        throw IoError(std::string("page directory mapping failed: ") + std::strerror(errno));
    void* touched = ::mmap(nullptr, touched_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                           off_t(header.touch_offset));
    if (touched == MAP_FAILED) {
        const int error = errno;
        ::munmap(entries, entries_bytes_);
        throw IoError(std::string("page directory mapping failed: ") + std::strerror(error));
    }
    entries_ = static_cast<uint8_t*>(entries);
    touched_ = static_cast<uint8_t*>(touched);
    slot_mask_ = header.slots - 1;
}

DirectoryReader::~DirectoryReader() {
    ::munmap(entries_, entries_bytes_);
    ::munmap(touched_, touched_bytes_);
}

std::optional<DirectoryReader::Hit> DirectoryReader::lookup(const std::string& key, uint32_t shard,
                                                            uint64_t token, bool read) const {
    const Header& header = *reinterpret_cast<const Header*>(entries_);
    const Slot* slots = reinterpret_cast<const Slot*>(entries_ + header.slots_offset);
    const XXH128_hash_t h = key_hash(key);
    const double now = monotonic_s();
    for (uint32_t probe = 0; probe < kDirectoryProbes; ++probe) {
        const uint32_t index = uint32_t(h.low64 + probe) & slot_mask_;
        Slot s;
        if (!read_locked(&slots[index], s)) return std::nullopt;  // busy: ask the worker
        if (s.state == kEmpty) return std::nullopt;  // never used: the key lies no further
        if (s.state != kLive || s.key_lo != h.low64 || s.key_hi != h.high64) continue;
        if (s.expires_at <= now || s.ndim > kDirectoryMaxDims) return std::nullopt;
        if (token != 0) {
            ShardLease lease;
            if (!s.home || s.shard != shard || shard >= header.shards ||
                !read_locked(reinterpret_cast<const ShardLease*>(entries_ + header.shards_offset) +
                                 shard,
                             lease) ||
                lease.token != token || lease.deadline <= now)
                return std::nullopt;
        }
        // Written only when a bit is missing: a hot page's byte is not dirtied on every read.
        const uint8_t bits = read ? kTouchUsed | kTouchRead : kTouchUsed;
        if ((__atomic_load_n(touched_ + index, __ATOMIC_RELAXED) & bits) != bits)
            __atomic_fetch_or(touched_ + index, bits, __ATOMIC_RELAXED);
        Hit hit;
        hit.offset = s.offset;
        hit.size_bytes = s.size_bytes;
        hit.dtype.assign(s.dtype, strnlen(s.dtype, sizeof(s.dtype)));
        hit.shape.assign(s.shape, s.shape + s.ndim);
        Digest digest;
        std::memcpy(digest.data(), s.hash, digest.size());
        hit.hash = hex(digest);
        return hit;
    }
    return std::nullopt;
}

}  // namespace tc
