// A caller's end of a same-host worker's page socket (page_server.h has the wire format).
// Requests go one at a time (a mutex per connection); page bytes are copied straight into the
// worker's pool, which the caller has mapped. A put is one round trip once the connection has
// regions in reserve: copy each page into a region the previous commit reserved (hashing it
// while it is in cache), then COMMIT, whose reply reserves as much again.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tensorcast/page.h"
#include "tensorcast/page_index.h"

namespace tc {

// A page a caller wants stored: where its bytes are now, and what they are.
struct PagePut : PageMeta {
    const uint8_t* data = nullptr;
    uint64_t size_bytes = 0;
};

class PageClient {
public:
    // Takes `fd`, a connected page socket. Each reply must arrive (and keep arriving) within
    // `timeout_ms`. Any failure to talk marks the client broken: its callers open a new one.
    PageClient(int fd, int timeout_ms);
    ~PageClient();
    PageClient(const PageClient&) = delete;
    PageClient& operator=(const PageClient&) = delete;

    // Errors the worker answers are thrown as StatusError of their kind; a failed connection
    // as StatusError("Unavailable").
    uint64_t hello(const std::string& token);  // -> the pool's size in bytes
    std::vector<uint64_t> alloc(const std::vector<uint64_t>& sizes);
    // Index pages written at their offsets; returns the regions reserved for the next put.
    std::vector<uint64_t> commit(double ttl_s, const std::vector<PageWrite>& pages,
                                 const std::vector<uint64_t>& ahead);
    std::vector<std::optional<PageWrite>> get(const std::vector<PageKey>& keys);
    std::vector<bool> exists(const std::vector<PageKey>& keys);

    // Stores `pages` in the pool (`pool`, `pool_bytes`: the worker's pool mapped here) in
    // batches of at most a quarter of it; returns each page's hash (hex). Regions come from the
    // reserve where it has the size, the rest from ALLOC; each commit reserves as much again
    // (at most min(kMaxSpareBytes, a quarter of the pool) per connection).
    std::vector<std::string> put(uint8_t* pool, uint64_t pool_bytes, double ttl_s,
                                 const std::vector<PagePut>& pages);

    // True when the worker closed its end (it never writes unasked). Waits for a call in flight.
    bool hung_up();
    void close();  // idempotent; later calls fail as Unavailable
    bool broken() const { return broken_; }
    int fd() const { return fd_; }  // -1 once closed
    std::map<uint64_t, std::vector<uint64_t>> spare() const;  // reserved regions: size -> offsets
    uint64_t requests_sent(uint8_t op) const;                 // per op, since it opened

private:
    std::vector<uint8_t> call(uint8_t op, const std::vector<uint8_t>& body);
    void wake();  // WAKE the worker's thread unless it answered moments ago
    std::vector<std::string> put_batch(uint8_t* pool, uint64_t pool_bytes, double ttl_s,
                                       const PagePut* pages, size_t count);

    int fd_;
    int timeout_ms_;
    std::mutex call_mutex_;           // one request on the socket at a time
    mutable std::mutex spare_mutex_;  // copies run outside the call mutex
    std::map<uint64_t, std::vector<uint64_t>> spare_;
    std::atomic<bool> broken_{false};
    std::chrono::steady_clock::time_point last_reply_{};  // under call_mutex_
    std::array<std::atomic<uint64_t>, 8> sent_{};
};

}  // namespace tc
