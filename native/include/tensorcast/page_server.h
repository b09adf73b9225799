// Same-host KV page operations served natively: a Unix socket next to the worker's local
// socket, one thread per connection, no GIL. Callers map the pool through the local socket
// (which hands them its memfd), write and read page bytes in place, and use this socket only
// for the small requests: allocate regions, commit written pages, look pages up.
//
// Wire format (little-endian). Every message is an 8-byte header + body:
//   u8 version (1) | u8 op (request) or status (reply: 0 ok, 1 error) | u16 0 | u32 body bytes
// Strings are u16 length + bytes; shapes u8 ndim + ndim x i64. Requests:
//   HELLO  1: str token                                  -> u64 arena bytes
//   ALLOC  2: u32 n, n x u64 size                        -> u32 n, n x u64 offset
//   COMMIT 3: f64 ttl_s, u32 n, n x write, u32 m, m x u64 size to reserve for the next put
//             write = str key, u32 shard, u64 token, str dtype, shape, u64 offset, u64 size,
//                     str hash                           -> u32 k, k x u64 reserved offset
//   GET    4: u32 n, n x (str key, u32 shard, u64 token) -> u32 n, n x (u8 found [, u64 offset,
//                                                         u64 size, str dtype, shape, str hash])
//             each page found is read: its lease runs at least its ttl_s from now
//   EXISTS 5: as GET                                     -> u32 n, n x u8 (renews nothing)
//   WAKE   6: empty body                                 -> no reply (the caller is about to
//             send a request: the connection's thread wakes up meanwhile)
// An error reply's body is str kind (a tensorcast.errors class name) + u32 length + message.
// A COMMIT's hash is the one the writer computed as it copied the page in (32 hex digits); the
// worker records it without hashing the region again: readers check every copy against it.
// The caller's end is tc::PageClient (page_client.h).
// The first message must be HELLO with the cluster token. Regions a connection allocated and
// has not committed are its own and are freed when it closes; it may hold at most 8192 of them
// and half the pool's bytes (ResourceExhausted beyond).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "tensorcast/page_index.h"

namespace tc {

constexpr uint8_t kPageProtocolVersion = 1;
constexpr uint32_t kMaxPageRequestBytes = 16u << 20;
// Regions reserved ahead per connection: at most this, and at most a quarter of the pool.
constexpr uint64_t kMaxSpareBytes = 64ull << 20;
constexpr uint32_t kMaxPageConnections = 256;

struct PageServerStats {
    uint64_t requests = 0;
    uint64_t errors_sent = 0;
    uint64_t active_connections = 0;
    uint64_t connections_accepted = 0;
    uint64_t uncommitted_bytes = 0;  // pool regions connections hold for pages not yet committed
};

class PageServer {
public:
    // `address` is a full Unix socket address (a leading NUL byte means the abstract namespace).
    PageServer(const std::string& address, std::shared_ptr<PageIndex> index, std::string token,
               uint64_t arena_bytes);
    ~PageServer();  // stop()
    PageServer(const PageServer&) = delete;
    PageServer& operator=(const PageServer&) = delete;

    PageServerStats stats() const;
    // Closes the listener and every connection, frees their regions, joins all threads.
    void stop();

    struct Impl;

private:
    std::unique_ptr<Impl> impl_;
};

}  // namespace tc
