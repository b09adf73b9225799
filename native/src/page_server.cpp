#include "tensorcast/page_server.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <cerrno>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <set>
#include <system_error>
#include <thread>

#include "net.h"
#include "page_wire.h"
#include "tensorcast/errors.h"

namespace tc {
namespace {

using net::Clock;

using page_wire::Reader;
using page_wire::Writer;
constexpr size_t kHeaderBytes = page_wire::kHeaderBytes;
constexpr int kBodyStallMs = 10000;  // a request's body must keep arriving
constexpr int kHelloWithinMs = 10000;  // a new connection authenticates this soon, or is closed
constexpr uint32_t kMaxErrorBytes = 4096;
// Engines send page requests back to back: after each reply, watch for the next request this
// long before sleeping (at most this much CPU per burst; halves a single page's round trip).
constexpr int kSpinUs = 100;

std::vector<std::pair<uint32_t, uint64_t>> named_leases(const std::vector<PageKey>& keys) {
    std::set<std::pair<uint32_t, uint64_t>> named;
    for (const auto& k : keys)
        if (k.token != 0) named.emplace(k.shard, k.token);
    return {named.begin(), named.end()};
}


struct Connection {
    net::Fd fd;
    std::thread thread;
    std::atomic<bool> finished{false};
    bool authenticated = false;
    net::Clock::time_point connected_at = net::Clock::now();
    std::map<uint64_t, uint64_t> regions;  // offset -> page size: allocated, not committed
};

}  // namespace

struct PageServer::Impl {
    std::shared_ptr<PageIndex> index;
    std::string token;
    uint64_t arena_bytes = 0;
    net::Fd listener;
    net::Fd wake;
    std::mutex connections_mutex;
    std::list<std::unique_ptr<Connection>> connections;
    std::thread accept_thread;
    std::once_flag stop_once;
    std::atomic<uint64_t> requests{0}, errors_sent{0}, active{0}, accepted{0};
    std::atomic<uint64_t> uncommitted{0};  // region_bytes() of every connection's regions

    void hold(Connection& c, uint64_t offset, uint64_t size_bytes) {
        c.regions[offset] = size_bytes;
        uncommitted += region_bytes(size_bytes);
    }
    void release(Connection& c, std::map<uint64_t, uint64_t>::iterator region) {
        uncommitted -= region_bytes(region->second);
        c.regions.erase(region);
    }

    void accept_loop();
    void serve(Connection& c);
    void handle(Connection& c, uint8_t op, const std::vector<uint8_t>& body, Writer& out);
    void commit(Connection& c, Reader& in, Writer& out);
    bool send(int fd, uint8_t status, const std::vector<uint8_t>& body);
};

PageServer::PageServer(const std::string& address, std::shared_ptr<PageIndex> index,
                       std::string token, uint64_t arena_bytes)
    : impl_(std::make_unique<Impl>()) {
    Impl& s = *impl_;
    if (token.empty()) throw std::invalid_argument("PageServer: empty token");
    s.index = std::move(index);
    s.token = std::move(token);
    s.arena_bytes = arena_bytes;
    s.wake = net::make_wake_fd();
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (address.empty() || address.size() >= sizeof addr.sun_path)
        throw std::invalid_argument("PageServer: bad socket address");
    std::memcpy(addr.sun_path, address.data(), address.size());
    const socklen_t size = socklen_t(offsetof(sockaddr_un, sun_path) + address.size());
    net::Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd.valid() || ::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), size) != 0 ||
        ::listen(fd.get(), 64) != 0)
        throw IoError("PageServer: cannot listen on the page socket: " +
                      std::string(std::strerror(errno)));
    net::set_nonblocking(fd.get());
    s.listener = std::move(fd);
    s.accept_thread = std::thread([&s] { s.accept_loop(); });
}

PageServer::~PageServer() { stop(); }

PageServerStats PageServer::stats() const {
    const Impl& s = *impl_;
    return {s.requests, s.errors_sent, s.active, s.accepted, s.uncommitted};
}

void PageServer::stop() {
    Impl& s = *impl_;
    std::call_once(s.stop_once, [&s] {
        net::signal_wake(s.wake.get());
        if (s.accept_thread.joinable()) s.accept_thread.join();
        std::lock_guard<std::mutex> lock(s.connections_mutex);
        net::join_all(s.connections);
        s.listener.reset();
    });
}

void PageServer::Impl::accept_loop() {
    for (;;) {
        const net::Wait wait = net::wait_for(listener.get(), POLLIN, wake.get(),
                                             Clock::now() + std::chrono::seconds(1));
        if (wait == net::Wait::kWoken) return;
        std::lock_guard<std::mutex> lock(connections_mutex);
        net::reap_finished(connections);
        if (wait == net::Wait::kTimeout) continue;
        for (;;) {
            net::Fd fd(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
            if (!fd.valid()) break;
            if (connections.size() >= kMaxPageConnections) continue;  // closes it: refused
            auto c = std::make_unique<Connection>();
            c->fd = std::move(fd);
            Connection* raw = c.get();
            connections.push_back(std::move(c));
            ++accepted;
            ++active;
            try {
                raw->thread = std::thread([this, raw] {
                    try {
                        serve(*raw);
                    } catch (const std::exception&) {  // bad_alloc: drop this connection only
                    }
                    std::vector<uint64_t> regions;
                    for (const auto& [offset, size] : raw->regions) regions.push_back(offset);
                    while (!raw->regions.empty()) release(*raw, raw->regions.begin());
                    try {
                        index->free(regions);
                    } catch (const std::exception&) {
                    }
                    ::shutdown(raw->fd.get(), SHUT_RDWR);
                    --active;
                    raw->finished = true;
                });
            } catch (const std::system_error&) {  // thread limit: refuse this one
                connections.pop_back();
                --active;
            }
        }
    }
}

bool PageServer::Impl::send(int fd, uint8_t status, const std::vector<uint8_t>& body) {
    uint8_t header[kHeaderBytes] = {kPageProtocolVersion, status, 0, 0};
    const uint32_t size = uint32_t(body.size());
    std::memcpy(header + 4, &size, 4);
    iovec iov[2] = {{header, kHeaderBytes}, {const_cast<uint8_t*>(body.data()), body.size()}};
    net::IoLimits limits;
    limits.wake_fd = wake.get();
    limits.stall_ms = kBodyStallMs;
    return net::send_all(fd, iov, 2, limits, nullptr) == net::Io::kOk;
}

void PageServer::Impl::serve(Connection& c) {
    const int fd = c.fd.get();
    std::vector<uint8_t> body;
    for (;;) {
        uint8_t header[kHeaderBytes];
        net::IoLimits idle;  // between requests a connection may wait as long as it likes
        idle.wake_fd = wake.get();
        idle.spin_us = kSpinUs;
        if (!c.authenticated)  // once it said HELLO
            idle.deadline = c.connected_at + std::chrono::milliseconds(kHelloWithinMs);
        if (net::recv_all(fd, header, kHeaderBytes, idle, nullptr) != net::Io::kOk) return;
        uint32_t size;
        std::memcpy(&size, header + 4, 4);
        std::vector<uint8_t> reply;
        bool keep = true;
        try {
            // A bad header leaves the stream unreadable: answer, then close.
            keep = false;
            if (header[0] != kPageProtocolVersion)
                throw StatusError("InvalidArgument",
                                  "page protocol version " + std::to_string(header[0]) +
                                      ", this worker speaks " +
                                      std::to_string(kPageProtocolVersion));
            if (size > kMaxPageRequestBytes)
                throw StatusError("InvalidArgument", "page request of " + std::to_string(size) +
                                                         " bytes, the limit is " +
                                                         std::to_string(kMaxPageRequestBytes));
            if (!c.authenticated && header[1] != page_wire::kHello)
                throw StatusError("Unauthenticated", "say HELLO with the token first");
            body.resize(size);
            net::IoLimits limits;
            limits.wake_fd = wake.get();
            limits.stall_ms = kBodyStallMs;
            if (!c.authenticated)
                limits.deadline = c.connected_at + std::chrono::milliseconds(kHelloWithinMs);
            if (net::recv_all(fd, body.data(), size, limits, nullptr) != net::Io::kOk) return;
            keep = true;
            // WAKE: a caller about to send a request (after copying a page) wakes this thread
            // now, so the wake-up overlaps its copy. No reply.
            if (header[1] == page_wire::kWake && size == 0) continue;
            ++requests;
            Writer out;
            handle(c, header[1], body, out);
            reply = std::move(out.out);
        } catch (const StatusError& e) {
            ++errors_sent;
            Writer error;
            error.str(e.kind);
            const size_t n = std::min<size_t>(std::strlen(e.what()), kMaxErrorBytes);
            error.number(uint32_t(n));
            error.out.insert(error.out.end(), e.what(), e.what() + n);
            send(fd, 1, error.out);
            if (!keep || !c.authenticated) return;
            continue;
        }
        if (!send(fd, 0, reply)) return;
    }
}

void PageServer::Impl::handle(Connection& c, uint8_t op, const std::vector<uint8_t>& body,
                              Writer& out) {
    using namespace page_wire;
    Reader in(body.data(), body.size());
    if (op == kHello) {
        const std::string given = in.str();
        in.end();
        if (!net::token_accepted(token, reinterpret_cast<const uint8_t*>(given.data()),
                                 given.size()))
            throw StatusError("Unauthenticated", "missing or wrong cluster token");
        c.authenticated = true;
        out.number(arena_bytes);
        return;
    }
    if (!c.authenticated) throw StatusError("Unauthenticated", "say HELLO with the token first");
    switch (op) {
        case kAlloc: {
            const std::vector<uint64_t> sizes = read_offsets(in);
            in.end();
            // Bounded per connection: one caller cannot hold most of the pool uncommitted
            // (allocating evicts other callers' pages to make room).
            uint64_t held = 0, wanted = 0;
            for (const auto& [offset, size] : c.regions) held += size;
            for (uint64_t n : sizes) wanted += std::min(n, kMaxPageBytes + 1);
            if (c.regions.size() + sizes.size() > 2 * kMaxPageBatch ||
                held + wanted > arena_bytes / 2)
                throw StatusError("ResourceExhausted",
                                  "this connection would hold " +
                                      std::to_string(c.regions.size() + sizes.size()) +
                                      " uncommitted page regions of " +
                                      std::to_string(held + wanted) +
                                      " bytes; the limit is " +
                                      std::to_string(2 * kMaxPageBatch) + " regions, " +
                                      std::to_string(arena_bytes / 2) +
                                      " bytes (half the pool): commit pages first");
            const auto offsets = index->allocate(sizes, true);
            for (size_t i = 0; i < offsets.size(); ++i) hold(c, offsets[i], sizes[i]);
            write_offsets(out, offsets);
            return;
        }
        case kCommit:
            commit(c, in, out);
            return;
        case kGet:
        case kExists: {
            const auto keys = read_keys(in);
            index->check_leases(named_leases(keys));
            const auto found = index->lookup(keys, /*read=*/op == kGet);  // a GET renews
            out.number(uint32_t(found.size()));
            for (const auto& page : found) {
                out.number(uint8_t(page.has_value()));
                if (op == kExists || !page) continue;
                out.number(page->offset);
                out.number(page->size_bytes);
                out.str(page->dtype);
                out.shape(page->shape);
                out.str(page->hash);
            }
            return;
        }
        default:
            throw StatusError("InvalidArgument", "unknown page operation " + std::to_string(op));
    }
}

void PageServer::Impl::commit(Connection& c, Reader& in, Writer& out) {
    const double ttl_s = in.number<double>();
    std::vector<PageWrite> writes(in.count(kMaxPageBatch, page_wire::kMinWriteBytes));
    for (auto& w : writes) w = page_wire::read_page(in);
    const std::vector<uint64_t> ahead = page_wire::read_offsets(in);
    in.end();
    // Only regions this connection allocated, each named once, with the page's size.
    std::set<uint64_t> named;
    for (const auto& w : writes) {
        auto region = c.regions.find(w.offset);
        if (region == c.regions.end() || region->second != w.size_bytes ||
            !named.insert(w.offset).second)
            throw StatusError("InvalidArgument",
                              "a page region is not this connection's, is named twice, or does "
                              "not have the page's size");
    }
    for (const auto& w : writes) release(c, c.regions.find(w.offset));
    std::set<std::pair<uint32_t, uint64_t>> leases;
    for (const auto& w : writes) leases.emplace(w.shard, w.token);
    try {
        index->check_leases({leases.begin(), leases.end()});
    } catch (...) {
        index->free({named.begin(), named.end()});
        throw;
    }
    // The writer hashed each page as it copied it in; the worker does not hash it again
    // (architecture.md decision 37): every reader checks the bytes it copies against it.
    CommitOptions options;
    options.check_hashes = false;
    index->commit(writes, ttl_s, options);  // frees the regions itself on error
    // Reserve as much again for the caller's next put, within a bound per connection; best
    // effort: a full pool reserves nothing and the next put allocates as usual.
    uint64_t spare = 0, wanted = 0;
    for (const auto& [offset, size] : c.regions) spare += size;
    for (uint64_t n : ahead) wanted += std::min(n, kMaxSpareBytes + 1);
    std::vector<uint64_t> offsets;
    if (!ahead.empty() && spare + wanted <= std::min(kMaxSpareBytes, arena_bytes / 4)) {
        try {
            offsets = index->allocate(ahead, false);
        } catch (const StatusError&) {
        }
    }
    for (size_t i = 0; i < offsets.size(); ++i) hold(c, offsets[i], ahead[i]);
    page_wire::write_offsets(out, offsets);
}

}  // namespace tc
