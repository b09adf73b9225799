// Loopback checks of DataServer + pull: correctness over 1..8 streams, fault
// injection (corrupt checksums, dying connections), auth/ticket rejection,
// timeout, cancellation, and the server's handling of malformed frames.
#include "check.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tensorcast/frame.h"
#include "tensorcast/transport.h"

namespace {

namespace f = tc::frame;
using Clock = std::chrono::steady_clock;


const std::string kToken = "s3cret-token";
constexpr uint64_t kPoolBytes = 64ull << 20;

std::vector<uint8_t> random_bytes(size_t size_bytes, unsigned seed) {
    std::mt19937_64 rng(seed);
    std::vector<uint8_t> bytes(size_bytes);
    size_t i = 0;
    for (; i + 8 <= size_bytes; i += 8) {
        const uint64_t v = rng();
        std::memcpy(&bytes[i], &v, 8);
    }
    for (; i < size_bytes; ++i) bytes[i] = uint8_t(rng());
    return bytes;
}

const std::vector<uint8_t>& pool() {
    static const std::vector<uint8_t> bytes = random_bytes(kPoolBytes, 7);
    return bytes;
}

double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

// Runs fn, expecting a TransferError-derived Error with the given failure.
template <typename Error, typename Fn>
bool fails_with(tc::TransferFailure failure, Fn&& fn) {
    try {
        fn();
    } catch (const Error& e) {
        if (e.failure() == failure) return true;
        std::fprintf(stderr, "  unexpected failure: %s\n", e.what());
        return false;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "  unexpected exception: %s\n", e.what());
        return false;
    }
    std::fprintf(stderr, "  no exception\n");
    return false;
}

struct Fixture {
    tc::DataServer server{"127.0.0.1", 0, pool().data(), kPoolBytes, kToken};
    uint64_t ticket = server.open_ticket(0, kPoolBytes, 60'000);

    tc::PullStats pull(uint64_t offset, uint64_t length, std::vector<uint8_t>& dest,
                       uint32_t streams, uint64_t chunk_bytes = 0, uint32_t timeout_ms = 30'000,
                       const std::string& token = kToken, uint64_t ticket_id = 0) {
        dest.assign(length, 0);
        return tc::pull("127.0.0.1", server.port(), token, ticket_id ? ticket_id : ticket, offset,
                        length, dest.data(), streams, chunk_bytes, timeout_ms, nullptr);
    }
};

bool equals_pool(const std::vector<uint8_t>& dest, uint64_t offset) {
    return std::memcmp(dest.data(), pool().data() + offset, dest.size()) == 0;
}

void test_pull_streams() {
    Fixture fx;
    std::vector<uint8_t> dest;
    for (uint32_t streams : {1u, 2u, 4u, 8u}) {
        const auto start = Clock::now();
        const tc::PullStats stats = fx.pull(0, kPoolBytes, dest, streams);
        CHECK(equals_pool(dest, 0));
        CHECK(stats.bytes == kPoolBytes && stats.chunks == 16 && stats.retries == 0);
        CHECK(stats.streams == streams);
        std::printf("pull 64 MiB, %u stream(s): %.2f GB/s\n", streams,
                    double(kPoolBytes) / seconds_since(start) / 1e9);
    }
    // Unaligned offset, odd chunk size, tail chunk shorter than the rest.
    const tc::PullStats stats = fx.pull(12345, (10 << 20) + 7, dest, 3, (1 << 20) + 3);
    CHECK(equals_pool(dest, 12345));
    CHECK(stats.chunks == 10);  // 9 of 1 MiB + 3, then the tail
    bool threw = false;
    try {  // 64 MiB in 1-byte chunks: refused up front, not a 64M-entry queue
        fx.pull(0, kPoolBytes, dest, 1, 1);
    } catch (const std::invalid_argument&) {
        threw = true;
    }
    CHECK(threw);
    // Zero length touches nothing (not even the network).
    CHECK(tc::pull("127.0.0.1", 1, kToken, 1, 0, 0, nullptr, 0, 0, 100, nullptr).bytes == 0);
    const tc::DataServerStats server_stats = fx.server.stats();
    CHECK(server_stats.bytes_sent == 4 * kPoolBytes + (10 << 20) + 7);
    CHECK(server_stats.errors_sent == 0);
}

void test_corrupt_chunks_are_retried() {
    Fixture fx;
    std::vector<uint8_t> dest;
    fx.server.inject_corrupt_chunks(3);
    const tc::PullStats stats = fx.pull(0, kPoolBytes, dest, 4);
    CHECK(equals_pool(dest, 0));
    CHECK(stats.checksum_failures == 3);
    CHECK(stats.retries == 3);
    // Every chunk corrupt: the pull gives up after kMaxChunkRetries.
    fx.server.inject_corrupt_chunks(1000);
    CHECK(fails_with<tc::TransferError>(tc::TransferFailure::kChecksumRetriesExhausted,
                                        [&] { fx.pull(0, 8 << 20, dest, 2); }));
}

void test_dying_connection() {
    Fixture fx;
    std::vector<uint8_t> dest;
    fx.server.inject_close_after_chunks(3);
    tc::PullStats stats = fx.pull(0, kPoolBytes, dest, 4);
    CHECK(equals_pool(dest, 0));
    CHECK(stats.retries >= 1);
    CHECK(stats.reconnects == 0);  // finished on the three other streams
    // A single stream that dies is replaced by a reconnect.
    fx.server.inject_close_after_chunks(2);
    stats = fx.pull(0, 32 << 20, dest, 1);
    CHECK(equals_pool(dest, 0));
    CHECK(stats.reconnects == 1 && stats.retries >= 1);
}

void test_rejections() {
    Fixture fx;
    std::vector<uint8_t> dest;
    CHECK(fails_with<tc::TransferError>(tc::TransferFailure::kBadToken,
                                        [&] { fx.pull(0, 1 << 20, dest, 2, 0, 5000, "wrong"); }));
    CHECK(fails_with<tc::TransferError>(
        tc::TransferFailure::kTicketRejected,
        [&] { fx.pull(0, 1 << 20, dest, 2, 0, 5000, kToken, 12345); }));
    const uint64_t short_lived = fx.server.open_ticket(0, 1 << 20, 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK(fails_with<tc::TransferError>(
        tc::TransferFailure::kTicketRejected,
        [&] { fx.pull(0, 1 << 20, dest, 2, 0, 5000, kToken, short_lived); }));
    const uint64_t closed = fx.server.open_ticket(0, 1 << 20, 60'000);
    fx.server.close_ticket(closed);
    CHECK(fails_with<tc::TransferError>(
        tc::TransferFailure::kTicketRejected,
        [&] { fx.pull(0, 1 << 20, dest, 2, 0, 5000, kToken, closed); }));
    // Ticket for [1 MiB, 2 MiB): a read starting below or running past it is refused.
    const uint64_t narrow = fx.server.open_ticket(1 << 20, 1 << 20, 60'000);
    fx.pull(1 << 20, 1 << 20, dest, 2, 256 << 10, 5000, kToken, narrow);
    CHECK(equals_pool(dest, 1 << 20));
    CHECK(fails_with<tc::TransferError>(
        tc::TransferFailure::kTicketRejected,
        [&] { fx.pull((1 << 20) + 1, 1 << 20, dest, 2, 0, 5000, kToken, narrow); }));
    CHECK(fails_with<tc::TransferError>(
        tc::TransferFailure::kTicketRejected,
        [&] { fx.pull((1 << 20) - 1, 4096, dest, 1, 0, 5000, kToken, narrow); }));
    // Tickets cannot reach outside the pool.
    bool threw = false;
    try {
        fx.server.open_ticket(kPoolBytes - 10, 11, 1000);
    } catch (const std::invalid_argument&) {
        threw = true;
    }
    CHECK(threw);
    CHECK(fx.server.stats().errors_sent >= 6);
}

// While the cluster token rotates a server holds "new,old": it accepts either, nothing else.
void test_rotating_tokens() {
    tc::DataServer server{"127.0.0.1", 0, pool().data(), kPoolBytes, "tok-new,tok-old"};
    const uint64_t ticket = server.open_ticket(0, 1 << 20, 60'000);
    std::vector<uint8_t> dest(1 << 20);
    for (const char* token : {"tok-new", "tok-old"}) {
        tc::pull("127.0.0.1", server.port(), token, ticket, 0, dest.size(), dest.data(), 2, 0,
                 30'000, nullptr);
        CHECK(equals_pool(dest, 0));
    }
    for (const char* token : {"tok-other", "tok-new,tok-old", "tok-ne", ","}) {
        CHECK(fails_with<tc::TransferError>(tc::TransferFailure::kBadToken, [&] {
            tc::pull("127.0.0.1", server.port(), token, ticket, 0, dest.size(), dest.data(), 1,
                     0, 30'000, nullptr);
        }));
    }
}

// A socket that listens but never accepts: connect succeeds (backlog), HELLO
// is never answered.
struct SilentListener {
    int fd = -1;
    uint16_t port = 0;
    SilentListener() {
        fd = ::socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in address{};
        address.sin_family = AF_INET;
        address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        CHECK(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
        CHECK(::listen(fd, 16) == 0);
        socklen_t size = sizeof address;
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size);
        port = ntohs(address.sin_port);
    }
    ~SilentListener() { ::close(fd); }
};

void test_timeout_and_cancel() {
    SilentListener silent;
    std::vector<uint8_t> dest(8 << 20);
    auto start = Clock::now();
    CHECK(fails_with<tc::TransferTimeout>(tc::TransferFailure::kTimeout, [&] {
        tc::pull("127.0.0.1", silent.port, kToken, 1, 0, dest.size(), dest.data(), 4, 0, 300,
                 nullptr);
    }));
    double elapsed = seconds_since(start);
    std::printf("timeout 300 ms took %.3f s\n", elapsed);
    // Upper bounds are loose on purpose: they catch a missed deadline, not a slow scheduler.
    CHECK(elapsed >= 0.29 && elapsed < 5);

    std::atomic<bool> cancel{false};
    std::thread canceller([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        cancel = true;
    });
    start = Clock::now();
    CHECK(fails_with<tc::TransferCancelled>(tc::TransferFailure::kCancelled, [&] {
        tc::pull("127.0.0.1", silent.port, kToken, 1, 0, dest.size(), dest.data(), 4, 0, 10'000,
                 &cancel);
    }));
    canceller.join();
    elapsed = seconds_since(start);
    std::printf("cancel after 200 ms took %.3f s\n", elapsed);
    CHECK(elapsed >= 0.19 && elapsed < 5);  // kCancelled, not the 10 s timeout
}

// A source that accepts (in its kernel's backlog) but never answers HELLO, as a stopped or cut-off
// process does, fails the pull after the stall limit: the rest of the deadline is left for
// another replica.
void test_unanswered_hello_fails_at_the_stall_limit() {
    SilentListener silent;
    std::vector<uint8_t> dest(8 << 20);
    const auto start = Clock::now();
    CHECK(fails_with<tc::TransferError>(tc::TransferFailure::kPeerClosed, [&] {
        tc::pull("127.0.0.1", silent.port, kToken, 1, 0, dest.size(), dest.data(), 4, 0, 60'000,
                 nullptr, {}, {}, /*stall_ms=*/300);
    }));
    const double elapsed = seconds_since(start);
    std::printf("unanswered HELLO, stall 300 ms, failed after %.3f s\n", elapsed);
    CHECK(elapsed >= 0.29 && elapsed < 30);  // no reconnects, nowhere near the 60 s deadline
}

// A source that answers HELLO, then freezes (a stopped process whose kernel still takes the
// READs): every stream stalls. The pull fails at the stall limit without reconnecting (each
// reconnect, on a pooled link that skips HELLO, waited a whole stall limit more: a frozen
// replica spent the caller's deadline while healthy ones waited).
void test_a_source_frozen_mid_pull_fails_at_the_stall_limit_without_reconnects() {
    SilentListener frozen;
    std::atomic<bool> stop{false};
    std::vector<int> accepted;
    std::thread server([&] {
        while (!stop) {
            pollfd p{frozen.fd, POLLIN, 0};
            if (::poll(&p, 1, 50) <= 0) continue;
            const int fd = ::accept(frozen.fd, nullptr, nullptr);
            if (fd < 0) continue;
            uint8_t header[tc::frame::kHeaderBytes];
            tc::frame::encode_header(tc::frame::hello_ok(), header);
            CHECK(::send(fd, header, sizeof header, MSG_NOSIGNAL) == ssize_t(sizeof header));
            accepted.push_back(fd);  // reads arrive and are never answered
        }
    });
    std::vector<uint8_t> dest(8 << 20);
    tc::PullStats stats;
    const auto start = Clock::now();
    CHECK(fails_with<tc::TransferError>(tc::TransferFailure::kPeerClosed, [&] {
        stats = tc::pull("127.0.0.1", frozen.port, kToken, 1, 0, dest.size(), dest.data(), 2, 0,
                         60'000, nullptr, {}, {}, /*stall_ms=*/300);
    }));
    const double elapsed = seconds_since(start);
    stop = true;
    server.join();
    std::printf("frozen after HELLO, stall 300 ms, 2 streams: failed after %.3f s, %zu connections\n",
                elapsed, accepted.size());
    CHECK(accepted.size() == 2);  // its two streams, no reconnect
    CHECK(elapsed >= 0.29 && elapsed < 30);
    for (int fd : accepted) ::close(fd);
}

void test_refused() {
    uint16_t port;
    {
        SilentListener closed_soon;
        port = closed_soon.port;
    }
    std::vector<uint8_t> dest(1 << 20);
    const auto start = Clock::now();
    CHECK(fails_with<tc::TransferError>(tc::TransferFailure::kRefused, [&] {
        tc::pull("127.0.0.1", port, kToken, 1, 0, dest.size(), dest.data(), 4, 0, 60'000,
                 nullptr);
    }));
    CHECK(seconds_since(start) < 10);  // two short backoffs, no waiting for the 60 s deadline
}

void test_server_stop_mid_pull() {
    auto fx = std::make_unique<Fixture>();
    std::vector<uint8_t> dest(kPoolBytes);
    std::thread stopper([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        fx->server.stop();
    });
    bool ended = false, failed_otherwise = false;
    // Pull (small chunks) until the stop ends a pull, however late the stopper runs.
    const auto start = Clock::now();
    while (!ended && !failed_otherwise && seconds_since(start) < 60) {
        try {
            tc::pull("127.0.0.1", fx->server.port(), kToken, fx->ticket, 0, kPoolBytes,
                     dest.data(), 4, 64 << 10, 10'000, nullptr);
        } catch (const tc::TransferError& e) {
            ended = e.failure() == tc::TransferFailure::kPeerClosed ||
                    e.failure() == tc::TransferFailure::kRefused;
            failed_otherwise = !ended;
            if (!ended) std::fprintf(stderr, "  %s\n", e.what());
        }
    }
    stopper.join();
    CHECK(ended);
    CHECK(fx->server.stats().active_connections == 0);
}

// Raw client helpers for protocol-level checks.
int raw_connect(uint16_t port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = htons(port);
    CHECK(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
    timeval tv{5, 0};  // a hung server fails the test instead of hanging it
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

// Reads one frame header (and discards its payload); false on EOF/error.
bool raw_read_frame(int fd, f::Header* h) {
    uint8_t raw[f::kHeaderBytes];
    if (::recv(fd, raw, sizeof raw, MSG_WAITALL) != ssize_t(sizeof raw)) return false;
    if (f::decode_header(raw, sizeof raw, h) != f::Status::kOk) return false;
    std::vector<uint8_t> payload(h->payload_bytes);
    return h->payload_bytes == 0 ||
           ::recv(fd, payload.data(), payload.size(), MSG_WAITALL) == ssize_t(payload.size());
}

bool raw_closed(int fd) {
    uint8_t byte;
    return ::recv(fd, &byte, 1, 0) <= 0;
}

void test_server_protocol_errors() {
    Fixture fx;
    f::Header h;
    {  // garbage header: ERROR(protocol), then close
        const int fd = raw_connect(fx.server.port());
        const char garbage[f::kHeaderBytes] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        CHECK(::send(fd, garbage, sizeof garbage, 0) == ssize_t(sizeof garbage));
        CHECK(raw_read_frame(fd, &h) && h.type == f::Type::kError &&
              h.a == uint64_t(f::ErrorCode::kProtocol));
        CHECK(raw_closed(fd));
        ::close(fd);
    }
    {  // READ before HELLO
        const int fd = raw_connect(fx.server.port());
        uint8_t raw[f::kHeaderBytes];
        f::encode_header(f::read(1, fx.ticket, 0, 10), raw);
        CHECK(::send(fd, raw, sizeof raw, 0) == ssize_t(sizeof raw));
        CHECK(raw_read_frame(fd, &h) && h.type == f::Type::kError &&
              h.a == uint64_t(f::ErrorCode::kNotAuthenticated));
        CHECK(raw_closed(fd));
        ::close(fd);
    }
    {  // valid session: HELLO, two pipelined READs, then an oversize READ
        const int fd = raw_connect(fx.server.port());
        uint8_t raw[3 * f::kHeaderBytes];
        f::encode_header(f::hello(uint32_t(kToken.size())), raw);
        CHECK(::send(fd, raw, f::kHeaderBytes, 0) == ssize_t(f::kHeaderBytes));
        CHECK(::send(fd, kToken.data(), kToken.size(), 0) == ssize_t(kToken.size()));
        CHECK(raw_read_frame(fd, &h) && h.type == f::Type::kHelloOk);
        f::encode_header(f::read(7, fx.ticket, 100, 1000), raw);
        f::encode_header(f::read(8, fx.ticket, 5000, 3), raw + f::kHeaderBytes);
        CHECK(::send(fd, raw, 2 * f::kHeaderBytes, 0) == ssize_t(2 * f::kHeaderBytes));
        CHECK(raw_read_frame(fd, &h) && h.type == f::Type::kData && h.request_id == 7 &&
              h.a == 100 && h.b == 1000);
        CHECK(raw_read_frame(fd, &h) && h.type == f::Type::kData && h.request_id == 8);
        f::encode_header(f::read(9, fx.ticket, 0, 1000), raw);
        raw[40 + 3] = 0x10;  // length 256 MiB + 1000: over the limit
        CHECK(::send(fd, raw, f::kHeaderBytes, 0) == ssize_t(f::kHeaderBytes));
        CHECK(raw_read_frame(fd, &h) && h.type == f::Type::kError &&
              h.a == uint64_t(f::ErrorCode::kProtocol));
        CHECK(raw_closed(fd));
        ::close(fd);
    }
}

void test_connection_cap() {
    Fixture fx;
    std::vector<int> fds;
    for (uint32_t i = 0; i < tc::kMaxServerConnections; ++i)
        fds.push_back(raw_connect(fx.server.port()));
    const auto start = Clock::now();
    while (fx.server.stats().active_connections < tc::kMaxServerConnections &&
           seconds_since(start) < 60)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    CHECK(fx.server.stats().active_connections == tc::kMaxServerConnections);
    const int extra = raw_connect(fx.server.port());
    f::Header h;
    CHECK(raw_read_frame(extra, &h) && h.type == f::Type::kError &&
          h.a == uint64_t(f::ErrorCode::kBusy));
    ::close(extra);
    CHECK(fx.server.stats().connections_refused == 1);
    for (int fd : fds) ::close(fd);
    // The slots come back once the server sees the closes.
    std::vector<uint8_t> dest;
    fx.pull(0, 1 << 20, dest, 2);
    CHECK(equals_pool(dest, 0));
    const auto stop_start = Clock::now();
    fx.server.stop();
    CHECK(seconds_since(stop_start) < 10);  // bounded, not instant: the machine may be loaded
}

// Connections pooled by clients must not lock new ones out: pulls under many tokens (each its
// own pool key) leave idle connections until the server is full, and the next pull still works.
void test_idle_pooled_connections_make_room() {
    std::string tokens;
    constexpr int kTokens = 64;  // 64 x 8 idle links would be twice the server's slots
    for (int i = 0; i < kTokens; ++i) tokens += (i ? ",tok-" : "tok-") + std::to_string(i);
    tc::DataServer server{"127.0.0.1", 0, pool().data(), kPoolBytes, tokens};
    const uint64_t ticket = server.open_ticket(0, 1 << 20, 60'000);
    std::vector<uint8_t> dest(1 << 20);
    const auto pull_as = [&](int i) {
        // 8 chunks of 128 KiB: 8 streams, each leaving its connection in the pool.
        tc::pull("127.0.0.1", server.port(), "tok-" + std::to_string(i), ticket, 0, dest.size(),
                 dest.data(), 8, 128 << 10, 30'000, nullptr);
        CHECK(equals_pool(dest, 0));
    };
    int i = 0;
    // Until the next pull's 8 connections cannot all get a free slot.
    while (i < kTokens &&
           server.stats().active_connections + 8 <= tc::kMaxServerConnections)
        pull_as(i++);
    CHECK(i < kTokens);
    for (int more = 0; more < 4 && i < kTokens; ++more) {
        try {
            pull_as(i++);
        } catch (const std::exception& e) {
            std::fprintf(stderr, "  pull %d with %llu connections open: %s\n", i,
                         (unsigned long long)server.stats().active_connections, e.what());
            CHECK(false);
        }
    }
    CHECK(server.stats().connections_refused == 0);
    CHECK(server.stats().connections_evicted > 0);
}

// Chain fan-out: a relay's pool receives a range while a reader pulls it from the relay.
void test_growing_range_serves_only_what_arrived() {
    constexpr uint64_t kSize = 16ull << 20, kStep = 1ull << 20;
    std::vector<uint8_t> relay_pool(kSize, 0);
    tc::DataServer relay{"127.0.0.1", 0, relay_pool.data(), kSize, kToken};
    relay.begin_growing(0, kSize);
    bool refused = false;
    try {
        relay.begin_growing(kSize / 2, kStep);  // overlaps
    } catch (const std::invalid_argument&) {
        refused = true;
    }
    CHECK(refused);
    const uint64_t ticket = relay.open_ticket(0, kSize, 60'000);
    std::vector<uint8_t> dest(kSize, 0);
    std::atomic<bool> pulled{false};
    std::thread reader([&] {
        tc::pull("127.0.0.1", relay.port(), kToken, ticket, 0, kSize, dest.data(), 4, kStep,
                 60'000, nullptr);
        pulled = true;
    });
    // The bytes arrive step by step; each is in place before it is announced. The reader gets
    // the final bytes only if nothing was served before it arrived (the pause gives it time to
    // try reading ahead: a server that served unannounced bytes would hand it zeros).
    for (uint64_t offset = 0; offset < kSize; offset += kStep) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        CHECK(!pulled);  // it cannot have finished: the rest has not arrived
        std::memcpy(relay_pool.data() + offset, pool().data() + offset, kStep);
        relay.advance_growing(0, offset + kStep);
    }
    reader.join();
    CHECK(equals_pool(dest, 0));

    // A real chain: source -> relay (its pull announces its verified prefix) -> reader.
    Fixture source;
    std::fill(relay_pool.begin(), relay_pool.end(), 0);
    relay.end_growing(0);
    relay.begin_growing(0, kSize);
    std::fill(dest.begin(), dest.end(), 0);
    std::vector<uint64_t> prefixes;
    std::thread reader2([&] {
        tc::pull("127.0.0.1", relay.port(), kToken, ticket, 0, kSize, dest.data(), 4, 0,
                 60'000, nullptr);
    });
    tc::pull("127.0.0.1", source.server.port(), kToken, source.ticket, 0, kSize,
             relay_pool.data(), 4, kStep, 60'000, nullptr, {}, [&](uint64_t received) {
                 prefixes.push_back(received);
                 relay.advance_growing(0, received);
             });
    reader2.join();
    CHECK(equals_pool(dest, 0));
    CHECK(!prefixes.empty() && prefixes.back() == kSize);
    CHECK(std::is_sorted(prefixes.begin(), prefixes.end()));
    CHECK(std::adjacent_find(prefixes.begin(), prefixes.end()) == prefixes.end());  // strictly

    // Abandoned (the relay's own pull failed): closing the ticket ends a waiting reader with
    // a rejection it can act on (try another source), not a stall.
    relay.end_growing(0);
    relay.begin_growing(0, kSize);
    const uint64_t doomed = relay.open_ticket(0, kSize, 60'000);
    std::thread closer([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let its READs wait
        relay.close_ticket(doomed);
    });
    CHECK(fails_with<tc::TransferError>(tc::TransferFailure::kTicketRejected, [&] {
        tc::pull("127.0.0.1", relay.port(), kToken, doomed, 0, kSize, dest.data(), 2, 0, 60'000,
                 nullptr);
    }));
    closer.join();
}

}  // namespace

int main() {
    const struct {
        const char* name;
        void (*run)();
    } tests[] = {
        {"pull_streams", test_pull_streams},
        {"corrupt_chunks_are_retried", test_corrupt_chunks_are_retried},
        {"dying_connection", test_dying_connection},
        {"rejections", test_rejections},
        {"rotating_tokens", test_rotating_tokens},
        {"timeout_and_cancel", test_timeout_and_cancel},
        {"unanswered_hello_fails_at_the_stall_limit",
         test_unanswered_hello_fails_at_the_stall_limit},
        {"a_source_frozen_mid_pull_fails_at_the_stall_limit_without_reconnects",
         test_a_source_frozen_mid_pull_fails_at_the_stall_limit_without_reconnects},
        {"refused", test_refused},
        {"server_stop_mid_pull", test_server_stop_mid_pull},
        {"server_protocol_errors", test_server_protocol_errors},
        {"connection_cap", test_connection_cap},
        {"idle_pooled_connections_make_room", test_idle_pooled_connections_make_room},
        {"growing_range_serves_only_what_arrived", test_growing_range_serves_only_what_arrived},
    };
    for (const auto& test : tests) {
        const int before = failures;
        const auto start = Clock::now();
        test.run();
        std::printf("%-28s %s (%.2f s)\n", test.name, failures == before ? "ok" : "FAILED",
                    seconds_since(start));
        std::fflush(stdout);
    }
    if (failures != 0) {
        std::fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    std::puts("all transport checks passed");
    return 0;
}
