// Plain C++ checks of the arena allocator and the KV page index; exits non-zero on any failure.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "tensorcast/arena.h"
#include "tensorcast/errors.h"
#include "tensorcast/hash.h"
#include "tensorcast/page_index.h"

namespace {

const tc::CommitOptions kHome{};                       // homed here, hashes checked
const tc::CommitOptions kCached{false, false, true};   // a cached copy (token 0)
const tc::CommitOptions kHomeIfAbsent{true, true, true};
const tc::CommitOptions kTrusted{true, false, false};  // the writer hashed it as it copied

// The kind of StatusError `fn` throws, or "" when it throws none.
template <typename Fn>
std::string error_kind(Fn&& fn) {
    try {
        fn();
    } catch (const tc::StatusError& e) {
        return e.kind;
    }
    return "";
}

std::string hex_hash(const uint8_t* data, size_t size) {
    const auto digests = tc::tree_hash_many({{data, size}}, 1);
    static const char* digits = "0123456789abcdef";
    std::string out;
    for (uint8_t b : digests[0]) {
        out += digits[b >> 4];
        out += digits[b & 15];
    }
    return out;
}

void test_arena_aligns_coalesces_and_reports_exhaustion() {
    tc::ArenaAllocator arena(16 * 4096);
    const uint64_t a = arena.allocate(1);
    const uint64_t b = arena.allocate(4097);
    const uint64_t c = arena.allocate(0);
    CHECK(a % 4096 == 0 && b % 4096 == 0 && c % 4096 == 0);
    CHECK(arena.size_of(b) == 2 * 4096 && arena.size_of(c) == 4096);
    CHECK(arena.used_bytes() == 4 * 4096);
    CHECK(error_kind([&] { arena.allocate(13 * 4096); }) == "ResourceExhausted");
    CHECK(error_kind([&] { arena.free(a + 4096 * 100); }) == "InvalidArgument");
    arena.free(b);
    arena.free(a);
    arena.free(c);
    CHECK(arena.used_bytes() == 0);
    const auto blocks = arena.free_blocks();
    CHECK(blocks.size() == 1 && blocks[0].first == 0 && blocks[0].second == 16 * 4096);
    CHECK(error_kind([] { tc::ArenaAllocator bad(4095); }) == "InvalidArgument");
}

// Waits until the monotonic clock reaches `t`.
void sleep_until(double t) {
    for (double now = tc::monotonic_s(); now < t; now = tc::monotonic_s())
        usleep(useconds_t(std::min(t - now, 0.05) * 1e6) + 1);
}

// Runs `attempt(ttl_s)` with ttl_s = 1, 2, 4, ... until one is conclusive (it returns false when
// the scheduler delayed it past a window it measured: that proves nothing either way, so lease
// tests never fail by timing under load, nor pass without having checked).
template <typename Attempt>
void with_growing_ttl(Attempt&& attempt) {
    for (double ttl_s = 1; ttl_s <= 16; ttl_s *= 2)
        if (attempt(ttl_s)) return;
    CHECK(!"no attempt ran within its window, even with a 16 s ttl");
}

struct Fixture {
    std::vector<uint8_t> memory = std::vector<uint8_t>(64 * 4096);
    std::shared_ptr<tc::ArenaAllocator> arena =
        std::make_shared<tc::ArenaAllocator>(64 * 4096);
    tc::PageIndex index{memory.data(), arena, {{"U8", 1}, {"F32", 4}}};

    // A page of `size` bytes filled with `fill`, written into a fresh region.
    tc::PageWrite write(const std::string& key, uint64_t size, uint8_t fill, uint32_t shard = 0,
                        uint64_t token = 1) {
        tc::PageWrite w;
        w.key = key;
        w.shard = shard;
        w.token = token;
        w.dtype = "U8";
        w.shape = {int64_t(size)};
        w.size_bytes = size;
        w.offset = index.allocate({size}, true)[0];
        std::memset(memory.data() + w.offset, fill, size);
        w.hash = hex_hash(memory.data() + w.offset, size);
        return w;
    }
};

void test_commit_checks_everything_and_is_all_or_nothing() {
    Fixture f;
    const uint64_t before = f.arena->used_bytes();
    auto good = f.write("a", 4096, 1);
    auto bad_hash = f.write("b", 4096, 2);
    bad_hash.hash = std::string(32, '0');
    CHECK(error_kind([&] { f.index.commit({good, bad_hash}, 60, kHome); }) ==
          "IntegrityError");
    CHECK(f.arena->used_bytes() == before);  // both regions given back
    CHECK(f.index.stats().pages == 0);

    auto shape = f.write("c", 4096, 3);
    shape.shape = {4097};
    CHECK(error_kind([&] { f.index.commit({shape}, 60, kHome); }) == "InvalidArgument");
    auto dtype = f.write("d", 4096, 3);
    dtype.dtype = "X9";
    CHECK(error_kind([&] { f.index.commit({dtype}, 60, kHome); }) == "InvalidArgument");
    auto key = f.write(std::string("bad\nkey"), 4096, 3);
    CHECK(error_kind([&] { f.index.commit({key}, 60, kHome); }) == "InvalidArgument");
    auto ttl = f.write("e", 4096, 3);
    CHECK(error_kind([&] { f.index.commit({ttl}, 0, kHome); }) == "InvalidArgument");
    CHECK(f.arena->used_bytes() == before && f.index.stats().pages == 0);

    auto bad_digits = f.write("g", 4096, 4);
    bad_digits.hash = std::string(31, '0') + "X";
    CHECK(error_kind([&] { f.index.commit({bad_digits}, 60, kTrusted); }) == "InvalidArgument");
    CHECK(f.arena->used_bytes() == before && f.index.stats().pages == 0);
    // Without the hash check the writer's claim is recorded as is (a reader that copies the
    // page checks its bytes against it); every other check still applies.
    auto claimed = f.write("h", 4096, 5);
    const std::string real = claimed.hash;
    claimed.hash = std::string(32, '0');
    auto wrong_size = f.write("i", 4096, 6);
    wrong_size.size_bytes = 4000;
    CHECK(error_kind([&] { f.index.commit({claimed, wrong_size}, 60, kTrusted); }) ==
          "InvalidArgument");
    CHECK(f.arena->used_bytes() == before && f.index.stats().pages == 0);
    claimed = f.write("h", 4096, 5);
    claimed.hash = std::string(32, '0');
    f.index.commit({claimed}, 60, kTrusted);
    const auto trusted = f.index.lookup({{"h", 0, 1}});
    CHECK(trusted[0] && trusted[0]->hash == std::string(32, '0') && real != trusted[0]->hash);

    auto ok = f.write("f", 8, 7);
    ok.dtype = "F32";
    ok.shape = {2};
    f.index.commit({ok}, 60, kHome);
    const auto found = f.index.lookup({{"f", 0, 1}, {"f", 3, 1}, {"f", 0, 0}, {"zz", 0, 0}});
    CHECK(found[0] && found[0]->hash == ok.hash && found[0]->shape == std::vector<int64_t>{2});
    CHECK(!found[1]);  // homed under another shard
    CHECK(found[2]);   // token 0: any copy
    CHECK(!found[3]);
}

void test_replacing_if_absent_lru_eviction_and_expiry() {
    Fixture f;
    f.index.commit({f.write("k", 4096, 1)}, 60, kHome);
    auto again = f.write("k", 4096, 2);
    f.index.commit({again}, 60, kHomeIfAbsent);  // if_absent: the live page stays
    CHECK(f.index.lookup({{"k", 0, 0}})[0]->hash != again.hash);
    CHECK(f.index.stats().pages == 1 && f.arena->used_bytes() == 4096);
    f.index.commit({f.write("k", 4096, 2)}, 60, kHome);  // replaced
    CHECK(f.index.lookup({{"k", 0, 0}})[0]->hash == again.hash);
    CHECK(f.arena->used_bytes() == 4096);

    // Fill the 64-page arena with 16-page pages: the least recently used goes first.
    for (int i = 0; i < 3; ++i)
        f.index.commit({f.write("big" + std::to_string(i), 16 * 4096, 9)}, 60, kHome);
    f.index.lookup({{"k", 0, 0}});  // touch: now the most recently used
    f.index.commit({f.write("big3", 16 * 4096, 9)}, 60, kHome);
    CHECK(!f.index.lookup({{"big0", 0, 0}})[0]);
    CHECK(f.index.lookup({{"k", 0, 0}})[0] && f.index.lookup({{"big3", 0, 0}})[0]);
    CHECK(error_kind([&] { f.index.allocate({65 * 4096}, true); }) == "ResourceExhausted");
    {  // Regions pages do not hold (an artifact's) leave too little room even with no page:
       // refused without evicting a page for nothing.
        const uint64_t held = f.arena->allocate(8 * 4096);
        const uint64_t pages_before = f.index.stats().pages;
        CHECK(error_kind([&] { f.index.allocate({60 * 4096}, true); }) == "ResourceExhausted");
        CHECK(f.index.stats().pages == pages_before);
        f.arena->free(held);
    }

    f.index.commit({f.write("short", 4096, 4)}, 1e-3, kHome);
    f.index.commit({f.write("copy", 4096, 5)}, 2e-3, kCached);  // a cached copy
    CHECK(f.index.stats().home_pages == 5 && f.index.stats().pages == 6);
    usleep(3000);
    CHECK(!f.index.lookup({{"short", 0, 0}})[0]);
    CHECK(f.index.expire() == 2);  // both, and nothing that is still live
    CHECK(f.index.stats().home_pages == 4 && f.index.stats().pages == 4);
    CHECK(f.index.expire() == 0);
    CHECK(f.index.drop_shards({0}, std::nullopt) == 4);  // k, big1, big2, big3
    CHECK(f.index.stats().pages == 0 && f.arena->used_bytes() == 0);
}

void test_leases_exact_match_then_fallback() {
    Fixture f;
    CHECK(error_kind([&] { f.index.check_leases({{0, 1}}); }) == "FencingError");
    f.index.set_leases({{0, {5, tc::monotonic_s() + 60}}, {1, {2, tc::monotonic_s() - 1}}});
    CHECK(error_kind([&] { f.index.check_leases({{0, 5}}); }).empty());
    CHECK(error_kind([&] { f.index.check_leases({{0, 4}}); }) == "FencingError");
    CHECK(error_kind([&] { f.index.check_leases({{1, 2}}); }) == "FencingError");  // expired
    std::vector<std::pair<uint32_t, uint64_t>> asked;
    f.index.set_lease_fallback([&](const std::vector<std::pair<uint32_t, uint64_t>>& named) {
        asked = named;
        if (named[0].second != 6) throw tc::StatusError("FencingError", "stale");
    });
    CHECK(error_kind([&] { f.index.check_leases({{0, 6}}); }).empty());
    CHECK(asked.size() == 1 && asked[0].second == 6);
    CHECK(error_kind([&] { f.index.check_leases({{0, 4}}); }) == "FencingError");
}

// The directory mirrors the index: what a reader finds there is what lookup() returns, for as
// long as lookup() would return it; leases gate home reads; reads count as uses for eviction.
void test_directory_mirrors_the_index() {
    Fixture f;
    auto directory = std::make_shared<tc::PageDirectory>(1);
    f.index.attach_directory(directory);
    const tc::DirectoryReader reader(directory->fd(), directory->size_bytes());
    CHECK(directory->slots() == 1024);

    auto a = f.write("a", 4096, 1, /*shard=*/3, /*token=*/7);
    f.index.commit({a}, 60, kHome);
    CHECK(!reader.lookup("a", 3, 7));  // no lease shown yet: ask the worker
    f.index.set_leases({{3, {7, tc::monotonic_s() + 60}}});
    auto hit = reader.lookup("a", 3, 7);
    CHECK(hit && hit->offset == a.offset && hit->size_bytes == 4096 && hit->hash == a.hash);
    CHECK(hit->dtype == "U8" && hit->shape == std::vector<int64_t>{4096});
    CHECK(!reader.lookup("a", 3, 6) && !reader.lookup("a", 4, 7));  // stale token, other shard
    CHECK(reader.lookup("a", 0, 0));                                // token 0: any copy
    CHECK(!reader.lookup("b", 0, 0));

    auto a2 = f.write("a", 4096, 2, 3, 7);  // replaced: the directory follows
    f.index.commit({a2}, 60, kHome);
    CHECK(reader.lookup("a", 3, 7)->hash == a2.hash);
    f.index.set_leases({});  // lease lost
    CHECK(!reader.lookup("a", 3, 7) && reader.lookup("a", 0, 0));
    f.index.drop_shards({3}, std::nullopt);
    CHECK(!reader.lookup("a", 0, 0));

    f.index.commit({f.write("short", 4096, 4)}, 1e-3, kCached);
    usleep(3000);
    CHECK(!reader.lookup("short", 0, 0));  // expired, though not yet removed
    f.index.expire();

    auto fat = f.write("fat", 4096, 5);  // more dimensions than a slot holds: socket only
    fat.shape = {1, 1, 1, 1, 1, 1, 4096};
    f.index.commit({fat}, 60, kCached);
    CHECK(!reader.lookup("fat", 0, 0) && f.index.lookup({{"fat", 0, 0}})[0]);

    // A page read only through the directory survives eviction over an untouched older one.
    f.index.drop_shards({0}, std::nullopt);
    f.index.expire();
    f.index.commit({f.write("old", 16 * 4096, 6)}, 60, kCached);
    f.index.commit({f.write("hot", 16 * 4096, 7)}, 60, kCached);
    f.index.commit({f.write("mid", 16 * 4096, 8)}, 60, kCached);
    // LRU order: fat, old, hot, mid. Reading "old" through the directory saves it.
    CHECK(reader.lookup("old", 0, 0));
    f.index.commit({f.write("new1", 16 * 4096, 9)}, 60, kCached);  // evicts fat
    f.index.commit({f.write("new2", 16 * 4096, 9)}, 60, kCached);  // old: 2nd chance; hot
    CHECK(reader.lookup("old", 0, 0) && !reader.lookup("hot", 0, 0));

    // Concurrent replacement: a reader sees the old page or the new one, never a mix. The
    // writer keeps replacing until the reader has looked many times (or a deadline passes), so
    // the check does not depend on when the scheduler first runs the reader.
    std::atomic<bool> stop{false}, started{false};
    std::atomic<int> torn{0}, seen{0};
    std::thread reading([&] {
        started = true;
        while (!stop) {
            auto h = reader.lookup("swap", 0, 0);
            if (!h) continue;
            ++seen;
            // size encodes the version (4096 * n bytes at an offset holding fill n)
            if (h->size_bytes % 4096 != 0 || h->shape[0] != int64_t(h->size_bytes)) ++torn;
        }
    });
    const double deadline = tc::monotonic_s() + 60;
    while (!started && tc::monotonic_s() < deadline) std::this_thread::yield();
    for (int i = 0; (i < 2000 || seen < 1000) && tc::monotonic_s() < deadline; ++i)
        f.index.commit({f.write("swap", 4096 * (1 + i % 2), uint8_t(i))}, 60, kCached);
    stop = true;
    reading.join();
    CHECK(torn == 0);
    CHECK(seen >= 1000);  // false only if the reader never ran within the deadline
}

// A read renews a page's lease for the ttl_s it was put with; a lookup alone (an exists) does
// not, nor does anything else: such pages expire on time, and so does a read page one ttl_s
// after its last read.
bool reads_renew_leases(double ttl) {
    Fixture f;
    const double put = tc::monotonic_s();
    f.index.commit({f.write("read", 4096, 1), f.write("looked", 4096, 2), f.write("idle", 4096, 3)},
                   ttl, kCached);
    const double committed = tc::monotonic_s();
    sleep_until(put + ttl / 2);
    const double read_at = tc::monotonic_s();
    const bool read = f.index.lookup({{"read", 0, 0}}, /*read=*/true)[0] &&
                      f.index.lookup({{"looked", 0, 0}})[0];
    const double read_done = tc::monotonic_s();
    sleep_until(committed + ttl * 1.25);  // past every original expiry
    const auto after = f.index.lookup({{"read", 0, 0}, {"looked", 0, 0}, {"idle", 0, 0}});
    const size_t expired = f.index.expire();
    const double checked = tc::monotonic_s();
    CHECK(!after[1] && !after[2]);  // not read: gone on time, whatever the timing
    // Conclusive when the read came before the original expiry (>= put + ttl) and the checks
    // before the renewed one (>= read_at + ttl).
    if (read_done >= put + ttl || checked >= read_at + ttl) return false;
    CHECK(read && after[0]);
    CHECK(expired == 2 && f.index.stats().pages == 1);
    sleep_until(read_done + ttl * 1.25);  // the renewed lease ends too
    CHECK(!f.index.lookup({{"read", 0, 0}})[0]);
    CHECK(f.index.expire() == 1 && f.index.stats().pages == 0);
    return true;
}

// Reads through the directory never reach the index: the slot's "read" mark renews a page that
// reaches its expiry (found by the sweep or by a lookup) instead of dropping it, and the
// renewed expiry is shown to directory readers. An exists through the directory renews
// nothing. Eviction's second chance takes only the "used" mark: it does not cost a page that
// is being read its renewal.
bool directory_reads_renew_leases(double ttl) {
    Fixture f;
    auto directory = std::make_shared<tc::PageDirectory>(1);
    f.index.attach_directory(directory);
    const tc::DirectoryReader reader(directory->fd(), directory->size_bytes());
    std::vector<tc::PageWrite> pages;
    for (const char* key : {"swept", "lazy", "exists", "idle", "victim"})
        pages.push_back(f.write(key, 4096, uint8_t(pages.size())));
    std::rotate(pages.begin() + 1, pages.end() - 1, pages.end());  // LRU: swept, victim, ...
    const double put = tc::monotonic_s();
    f.index.commit(pages, ttl, kCached);
    const double committed = tc::monotonic_s();
    const bool read = reader.lookup("swept", 0, 0, /*read=*/true) &&
                      reader.lookup("lazy", 0, 0, /*read=*/true) &&
                      reader.lookup("exists", 0, 0, /*read=*/false);
    // Room for 60 pages evicts one: "swept" gets its second chance, "victim" (the last region)
    // goes.
    f.index.free(f.index.allocate({60 * 4096}, true));
    const bool evicted = !f.index.lookup({{"victim", 0, 0}})[0];
    const double read_done = tc::monotonic_s();

    sleep_until(committed + ttl * 1.25);  // past every original expiry
    const double lazy_at = tc::monotonic_s();
    const bool lazy = bool(f.index.lookup({{"lazy", 0, 0}})[0]);  // renewed by this lookup
    const size_t expired = f.index.expire();  // renews "swept"; "exists" and "idle" go
    const bool shown = bool(reader.lookup("swept", 0, 0));  // not a read: no mark for expiry
    const double swept_done = tc::monotonic_s();
    CHECK(!f.index.lookup({{"exists", 0, 0}})[0] && !f.index.lookup({{"idle", 0, 0}})[0]);
    if (read_done >= put + ttl || swept_done >= lazy_at + ttl) return false;
    CHECK(read && evicted && lazy && shown && expired == 2 && f.index.stats().pages == 2);

    sleep_until(swept_done + ttl * 1.25);  // the marks were taken: no read since, so both go
    CHECK(f.index.expire() == 2 && f.index.stats().pages == 0);
    CHECK(!reader.lookup("swept", 0, 0));
    return true;
}

void test_reads_renew_leases() {
    with_growing_ttl(reads_renew_leases);
    with_growing_ttl(directory_reads_renew_leases);
}

}  // namespace

int main() {
    test_arena_aligns_coalesces_and_reports_exhaustion();
    test_commit_checks_everything_and_is_all_or_nothing();
    test_replacing_if_absent_lru_eviction_and_expiry();
    test_leases_exact_match_then_fallback();
    test_directory_mirrors_the_index();
    test_reads_renew_leases();
    if (failures) std::fprintf(stderr, "%d check(s) failed\n", failures);
    return failures ? 1 : 0;
}
