// Data plane: bulk worker-to-worker transfer of shared-memory ranges over
// several parallel TCP streams (wire format in frame.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tensorcast/errors.h"

namespace tc {

class RemotePageService;

constexpr uint32_t kDefaultPullStreams = 4;
constexpr uint32_t kMaxPullStreams = 64;
constexpr uint64_t kDefaultPullChunkBytes = 4ull << 20;
constexpr uint32_t kMaxReadsInFlight = 4;  // per connection
constexpr uint32_t kMaxChunkRetries = 3;
constexpr uint32_t kMaxReconnects = 2;     // per pull, once every connection has died
// Beyond this a data server closes its longest-idle authenticated data connection to make room,
// or refuses the new one (ERROR busy) when none is idle.
constexpr uint32_t kMaxServerConnections = 256;
// A READ of a growing range waits this long at most for its bytes to arrive (then ERROR busy):
// below a puller's 10 s receive stall, so the reader sees a reason, not a silent stall.
constexpr int kGrowingWaitMs = 8'000;

// PEM files for mutual TLS on the data plane: the CA that signs every member, and this
// process's certificate and key. An empty `ca` means plaintext.
struct TlsFiles {
    std::string ca, cert, key;
    bool enabled() const { return !ca.empty(); }
};

struct DataServerStats {
    uint64_t bytes_sent = 0;         // DATA payload bytes fully handed to the kernel
    uint64_t chunks_sent = 0;        // READs answered in full
    uint64_t active_connections = 0;
    uint64_t connections_accepted = 0;
    uint64_t connections_refused = 0;  // over kMaxServerConnections
    uint64_t connections_evicted = 0;  // idle ones closed to make room for a new one
    uint64_t errors_sent = 0;          // ERROR frames (bad token, ticket, protocol, ...)
};

// Serves READs of [base, base + size_bytes) to authenticated clients, one
// thread per connection plus an accept thread. The memory must stay mapped
// until stop() has returned (or the destructor has run). All methods are
// thread-safe.
class DataServer {
public:
    // host: numeric address or name to bind ("0.0.0.0", "::", "127.0.0.1");
    // port 0 picks an ephemeral port. Throws IoError if it cannot listen and
    // std::invalid_argument for an empty or oversize (> 1 KiB) token or unusable TLS files.
    // With `tls`, every connection must complete a mutual TLS handshake first.
    DataServer(const std::string& host, uint16_t port, const uint8_t* base, uint64_t size_bytes,
               std::string token, const TlsFiles& tls = {});
    ~DataServer();  // stop()
    DataServer(const DataServer&) = delete;
    DataServer& operator=(const DataServer&) = delete;

    uint16_t port() const;

    // Only ranges inside a live ticket can be read. Returns a random non-zero
    // id; throws std::invalid_argument if the range is outside the pool or
    // ttl_ms is 0. Expiry is checked when the ticket is used.
    uint64_t open_ticket(uint64_t offset, uint64_t length_bytes, uint32_t ttl_ms);
    void close_ticket(uint64_t id);  // unknown ids are ignored
    // Tickets not read for idle_ms (since opened or since their last READ): a puller that
    // died leaves its ticket idle, and the owner frees what the ticket holds before it expires.
    std::vector<uint64_t> idle_tickets(uint32_t idle_ms) const;

    // Growing ranges (chain fan-out): [offset, offset + length_bytes) of the pool is being
    // received by a pull. A READ reaching past what has arrived waits for it (at most
    // kGrowingWaitMs), so a replica in flight serves its received prefix onward.
    // advance_growing() only moves forward; end_growing() lifts the wait (received in full,
    // or abandoned: the owner closes the tickets on the range first). Throws
    // std::invalid_argument for a range outside the pool or one overlapping another.
    void begin_growing(uint64_t offset, uint64_t length_bytes);
    void advance_growing(uint64_t offset, uint64_t received_bytes);
    void end_growing(uint64_t offset);  // unknown offsets are ignored

    // Test hooks; a "chunk" is the full answer to one READ. The next n chunks
    // (any connection) each carry one DATA frame whose checksum has a bit
    // flipped; the memory itself is never touched. n = 0 disarms.
    void inject_corrupt_chunks(uint32_t n);
    // The connection that sends the n-th next chunk resets (RST) right after
    // it, like a crashed source. n = 0 disarms.
    void inject_close_after_chunks(uint32_t n);

    DataServerStats stats() const;

    // From now on, connections that speak the page protocol (their first byte is its version,
    // page_remote.h) are served by `pages`: KV pages for callers on other hosts, on this port.
    void serve_pages(std::shared_ptr<RemotePageService> pages);

    // Closes the listener and every connection and joins all threads; every
    // wait inside them is bounded by a stop signal, so this returns promptly.
    // Idempotent.
    void stop();

    struct Impl;

private:
    std::unique_ptr<Impl> impl_;
};

struct PullStats {
    uint64_t bytes = 0;              // verified payload bytes written to dest
    uint64_t chunks = 0;             // verified chunks
    uint64_t retries = 0;            // chunk re-queues (checksum or connection loss)
    uint64_t checksum_failures = 0;
    uint64_t reconnects = 0;
    uint64_t streams = 0;            // connections opened at start
    uint64_t elapsed_ms = 0;
};

// Pulls [source_offset, source_offset + length_bytes) of the server's pool into
// dest[0, length_bytes) over `streams` connections (0 = kDefaultPullStreams),
// in chunks of chunk_bytes (0 = kDefaultPullChunkBytes, max 64 MiB). Every
// chunk is verified (XXH3-64) and retried on another connection on mismatch or
// connection loss. Throws TransferTimeout after timeout_ms (0 = no deadline is
// not allowed: std::invalid_argument), TransferCancelled once *cancel becomes
// true (polled every <= 50 ms; cancel may be null), TransferError otherwise.
// Returns or throws only after every thread it started has been joined, so no
// byte of dest is written after it returns. On failure dest holds garbage. With `tls`, every
// connection is mutual TLS and the server's certificate must name `host`; a failed handshake
// fails the pull (TransferFailure::kTls). `on_prefix`, if set, is called (from the pull's
// threads, in increasing order) with the length of dest's prefix whose chunks have all been
// verified: what a relay may already serve onward (DataServer::advance_growing).
// A connection that hears nothing for `stall_ms` (0 = 10 s) while it awaits bytes is lost (the
// others and reconnects carry on); one that gets no answer to connecting or HELLO in that time
// is lost without a reconnect, so a frozen source fails the pull (kPeerClosed / kRefused) well
// before the deadline and the caller can try another replica.
PullStats pull(const std::string& host, uint16_t port, const std::string& token, uint64_t ticket,
               uint64_t source_offset, uint64_t length_bytes, uint8_t* dest, uint32_t streams,
               uint64_t chunk_bytes, uint32_t timeout_ms, const std::atomic<bool>* cancel,
               const TlsFiles& tls = {},
               const std::function<void(uint64_t)>& on_prefix = {}, uint32_t stall_ms = 0);

}  // namespace tc
