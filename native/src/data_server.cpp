#include <netinet/in.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <system_error>
#include <thread>
#include <unordered_map>

#include "net.h"
#include "tls.h"
#include "tensorcast/frame.h"
#include "tensorcast/page_remote.h"
#include "tensorcast/page_server.h"
#include "tensorcast/transport.h"

#include "xxh.h"

namespace tc {
namespace {

using net::Clock;

constexpr int kHandshakeTimeoutMs = 10'000;      // HELLO must arrive this soon
// No READ for this long: close. Clients pool an idle connection for 30 s at most (LinkPool),
// so one idle longer is not reused, yet it would keep a thread and one of the
// kMaxServerConnections slots.
constexpr int kIdleTimeoutMs = 60'000;
constexpr int kSendStallTimeoutMs = 30'000;      // client stopped reading
constexpr size_t kTicketSweepThreshold = 4096;   // prune expired tickets above this
constexpr int kListenBacklog = 512;

uint64_t random_u64() {
    uint64_t value = 0;
    uint8_t* p = reinterpret_cast<uint8_t*>(&value);
    size_t filled = 0;
    while (filled < sizeof value) {
        const ssize_t n = ::getrandom(p + filled, sizeof value - filled, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            throw IoError(std::string("getrandom failed: ") + std::strerror(errno));
        }
        filled += size_t(n);
    }
    return value;
}

// Atomically takes one unit from a countdown; returns the value before, or 0.
uint32_t take_one(std::atomic<uint32_t>& counter) {
    uint32_t value = counter.load();
    while (value != 0 && !counter.compare_exchange_weak(value, value - 1)) {
    }
    return value;
}

struct Ticket {
    uint64_t offset;
    uint64_t length_bytes;
    Clock::time_point expires;
    Clock::time_point last_used;  // opened, or last allowed READ
};

// A data connection's state between requests, for evicting idle ones when the server is full.
enum Idle : int { kBusy = 0, kWaiting = 1, kEvicted = 2 };

struct Connection {
    net::Fd fd;
    tls::Session session;  // after a TLS handshake (TLS servers only)
    std::thread thread;
    std::atomic<bool> finished{false};
    // kWaiting: authenticated and waiting for its next READ (idle in a client's pool, mostly).
    // The accept thread moves it to kEvicted and shuts the socket; whichever of the two sides
    // changes the state first decides whether a request that arrives meanwhile is served.
    std::atomic<int> idle{kBusy};
    std::atomic<int64_t> idle_since{0};  // steady clock ticks, set before idle = kWaiting
    bool evicted = false;                // guarded by the server's connections_mutex
};

}  // namespace

struct DataServer::Impl {
    const uint8_t* base;
    uint64_t size_bytes;
    std::string token;
    tls::Context tls;  // null: plaintext
    net::Fd listener;
    net::Fd wake;  // written once by stop(); wakes every poll of every thread
    uint16_t port = 0;

    std::mutex tickets_mutex;  // guards tickets, growing and stopping
    std::condition_variable tickets_changed;  // a growing range advanced or ended, a ticket closed
    std::unordered_map<uint64_t, Ticket> tickets;
    struct Growing {
        uint64_t length_bytes;
        uint64_t received_bytes;
    };
    std::map<uint64_t, Growing> growing;  // by pool offset; ranges never overlap
    bool stopping = false;

    std::mutex connections_mutex;
    std::list<std::unique_ptr<Connection>> connections;
    std::thread accept_thread;
    std::once_flag stop_once;

    std::mutex pages_mutex;
    std::shared_ptr<RemotePageService> pages;  // null: this port serves no pages

    std::atomic<uint32_t> corrupt_countdown{0};
    std::atomic<uint32_t> close_countdown{0};
    std::atomic<uint64_t> bytes_sent{0}, chunks_sent{0}, active{0}, accepted{0}, refused{0},
        errors_sent{0}, evicted{0};

    void accept_loop();
    // With connections_mutex held: connections that still hold a slot; when all slots are
    // taken, frees one by closing the longest-idle authenticated data connection, if any.
    bool make_room();
    void serve(Connection* connection);
    // Outcome of a ticket check for one READ; waits (bounded) for bytes of a growing range.
    frame::ErrorCode check_read(uint64_t ticket, uint64_t offset, uint64_t length_bytes,
                                bool* ok);
    // Where the received part of the growing range holding `offset` ends; UINT64_MAX: none.
    uint64_t received_end(uint64_t offset) const;
    // `ssl`: the connection's TLS session, if any.
    bool send_error(int fd, uint64_t request_id, frame::ErrorCode code, const std::string& text,
                    ssl_st* ssl = nullptr);
    // An error in the page protocol's framing (to a page client), then the connection closes.
    void send_page_error(int fd, const std::string& kind, const std::string& text, ssl_st* ssl);
};

DataServer::DataServer(const std::string& host, uint16_t port, const uint8_t* base,
                       uint64_t size_bytes, std::string token, const TlsFiles& tls)
    : impl_(std::make_unique<Impl>()) {
    if (token.empty() || token.size() > frame::kMaxTokenBytes)
        throw std::invalid_argument("DataServer: token must be 1..1024 bytes");
    if (base == nullptr && size_bytes != 0)
        throw std::invalid_argument("DataServer: null base with non-zero size");
    Impl& s = *impl_;
    s.base = base;
    s.size_bytes = size_bytes;
    s.token = std::move(token);
    if (tls.enabled()) s.tls = tls::make_context(tls, true);
    s.wake = net::make_wake_fd();

    std::string error;
    const auto addresses = net::resolve(host, port, true, &error);
    if (addresses.empty()) throw IoError("DataServer: " + error);
    int last_errno = 0;
    const char* last_call = "socket";
    for (const auto& address : addresses) {
        net::Fd fd(::socket(address.family, SOCK_STREAM | SOCK_CLOEXEC, 0));
        if (!fd.valid()) {
            last_errno = errno;
            continue;
        }
        const int one = 1;
        ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        // Accepted sockets inherit these; buffer sizes must precede the handshake.
        net::tune_socket(fd.get());
        if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&address.storage),
                   address.size_bytes) != 0) {
            last_errno = errno;
            last_call = "bind";
            continue;
        }
        if (::listen(fd.get(), kListenBacklog) != 0) {
            last_errno = errno;
            last_call = "listen";
            continue;
        }
        s.listener = std::move(fd);
        break;
    }
    if (!s.listener.valid())
        throw IoError("DataServer: " + std::string(last_call) + " " + net::describe(host, port) +
                      " failed: " + std::strerror(last_errno));
    sockaddr_storage bound{};
    socklen_t bound_size = sizeof bound;
    ::getsockname(s.listener.get(), reinterpret_cast<sockaddr*>(&bound), &bound_size);
    s.port = bound.ss_family == AF_INET6
                 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                 : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    net::set_nonblocking(s.listener.get());
    s.accept_thread = std::thread([&s] { s.accept_loop(); });
}

DataServer::~DataServer() { stop(); }

uint16_t DataServer::port() const { return impl_->port; }

uint64_t DataServer::open_ticket(uint64_t offset, uint64_t length_bytes, uint32_t ttl_ms) {
    Impl& s = *impl_;
    if (offset > s.size_bytes || length_bytes > s.size_bytes - offset)
        throw std::invalid_argument("open_ticket: range [" + std::to_string(offset) + ", +" +
                                    std::to_string(length_bytes) + ") outside the pool of " +
                                    std::to_string(s.size_bytes) + " bytes");
    if (ttl_ms == 0) throw std::invalid_argument("open_ticket: ttl_ms must be > 0");
    const auto now = Clock::now();
    std::lock_guard<std::mutex> lock(s.tickets_mutex);
    if (s.tickets.size() >= kTicketSweepThreshold) {
        for (auto it = s.tickets.begin(); it != s.tickets.end();)
            it = it->second.expires <= now ? s.tickets.erase(it) : std::next(it);
    }
    uint64_t id = 0;
    while (id == 0 || s.tickets.count(id) != 0) id = random_u64();
    s.tickets[id] = Ticket{offset, length_bytes, now + std::chrono::milliseconds(ttl_ms), now};
    return id;
}

std::vector<uint64_t> DataServer::idle_tickets(uint32_t idle_ms) const {
    const auto before = Clock::now() - std::chrono::milliseconds(idle_ms);
    std::lock_guard<std::mutex> lock(impl_->tickets_mutex);
    std::vector<uint64_t> idle;
    for (const auto& [id, ticket] : impl_->tickets)
        if (ticket.last_used < before) idle.push_back(id);
    return idle;
}

void DataServer::close_ticket(uint64_t id) {
    std::lock_guard<std::mutex> lock(impl_->tickets_mutex);
    if (impl_->tickets.erase(id) != 0) impl_->tickets_changed.notify_all();
}

void DataServer::begin_growing(uint64_t offset, uint64_t length_bytes) {
    Impl& s = *impl_;
    if (offset > s.size_bytes || length_bytes > s.size_bytes - offset || length_bytes == 0)
        throw std::invalid_argument("begin_growing: range outside the pool or empty");
    std::lock_guard<std::mutex> lock(s.tickets_mutex);
    const auto next = s.growing.lower_bound(offset);
    const bool overlaps_next = next != s.growing.end() && next->first < offset + length_bytes;
    const bool overlaps_previous =
        next != s.growing.begin() &&
        std::prev(next)->first + std::prev(next)->second.length_bytes > offset;
    if (overlaps_next || overlaps_previous)
        throw std::invalid_argument("begin_growing: range overlaps a growing range");
    s.growing[offset] = Impl::Growing{length_bytes, 0};
}

void DataServer::advance_growing(uint64_t offset, uint64_t received_bytes) {
    Impl& s = *impl_;
    std::lock_guard<std::mutex> lock(s.tickets_mutex);
    const auto it = s.growing.find(offset);
    if (it == s.growing.end()) return;
    const uint64_t received = std::min(received_bytes, it->second.length_bytes);
    if (received > it->second.received_bytes) {
        it->second.received_bytes = received;
        s.tickets_changed.notify_all();
    }
}

void DataServer::end_growing(uint64_t offset) {
    std::lock_guard<std::mutex> lock(impl_->tickets_mutex);
    if (impl_->growing.erase(offset) != 0) impl_->tickets_changed.notify_all();
}

void DataServer::serve_pages(std::shared_ptr<RemotePageService> pages) {
    std::lock_guard<std::mutex> lock(impl_->pages_mutex);
    impl_->pages = std::move(pages);
}

void DataServer::inject_corrupt_chunks(uint32_t n) { impl_->corrupt_countdown = n; }
void DataServer::inject_close_after_chunks(uint32_t n) { impl_->close_countdown = n; }

DataServerStats DataServer::stats() const {
    const Impl& s = *impl_;
    DataServerStats out;
    out.bytes_sent = s.bytes_sent;
    out.chunks_sent = s.chunks_sent;
    out.active_connections = s.active;
    out.connections_accepted = s.accepted;
    out.connections_refused = s.refused;
    out.connections_evicted = s.evicted;
    out.errors_sent = s.errors_sent;
    return out;
}

void DataServer::stop() {
    Impl& s = *impl_;
    std::call_once(s.stop_once, [&s] {
        {
            std::lock_guard<std::mutex> lock(s.tickets_mutex);
            s.stopping = true;  // READs waiting on growing ranges give up
            s.tickets_changed.notify_all();
        }
        net::signal_wake(s.wake.get());
        if (s.accept_thread.joinable()) s.accept_thread.join();
        // No new connections now; each thread sees the wake fd within one poll.
        std::lock_guard<std::mutex> lock(s.connections_mutex);
        net::join_all(s.connections);
        s.listener.reset();
    });
}

void DataServer::Impl::accept_loop() {
    for (;;) {
        // Wake at least every second to reap finished connection threads.
        const net::Wait wait = net::wait_for(listener.get(), POLLIN, wake.get(),
                                             Clock::now() + std::chrono::seconds(1));
        if (wait == net::Wait::kWoken) return;
        {
            std::lock_guard<std::mutex> lock(connections_mutex);
            net::reap_finished(connections);
        }
        if (wait == net::Wait::kTimeout) continue;
        for (;;) {
            net::Fd fd(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
            if (!fd.valid()) {
                // Out of fds/memory leaves the listener readable: pause rather than spin.
                if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR &&
                    errno != ECONNABORTED)
                    net::wait_for(wake.get(), POLLIN, -1,
                                  Clock::now() + std::chrono::milliseconds(100));
                break;
            }
            std::lock_guard<std::mutex> lock(connections_mutex);
            if (!make_room()) {
                ++refused;
                send_error(fd.get(), 0, frame::ErrorCode::kBusy, "too many connections");
                continue;  // fd closes here
            }
            ++accepted;
            ++active;
            auto connection = std::make_unique<Connection>();
            connection->fd = std::move(fd);
            Connection* raw = connection.get();
            connections.push_back(std::move(connection));
            try {
                raw->thread = std::thread([this, raw] {
                    try {
                        serve(raw);
                    } catch (const std::exception&) {  // bad_alloc: drop the connection only
                    }
                    // The peer sees the end now; the fd itself is closed by the reaper
                    // after the join, so its number cannot be reused under us.
                    if (raw->fd.valid()) ::shutdown(raw->fd.get(), SHUT_RDWR);
                    --active;
                    raw->finished = true;
                });
            } catch (const std::system_error&) {  // thread limit: refuse this one
                connections.pop_back();
                --active;
                --accepted;
                ++refused;
            }
        }
    }
}

bool DataServer::Impl::make_room() {
    size_t holding = 0;
    Connection* oldest = nullptr;
    int64_t oldest_since = 0;
    for (const auto& c : connections) {
        if (c->finished || c->evicted) continue;
        ++holding;
        const int64_t since = c->idle_since.load();
        if (c->idle.load() == kWaiting && (oldest == nullptr || since < oldest_since)) {
            oldest = c.get();
            oldest_since = since;
        }
    }
    if (holding < kMaxServerConnections) return true;
    // Pooled connections from many clients (or tokens) would otherwise fill every slot and
    // refuse all new ones, including KV page calls. Its client sees the close when it takes
    // the connection from its pool (or on its next READ) and connects again.
    int expected = kWaiting;
    if (oldest == nullptr || !oldest->idle.compare_exchange_strong(expected, kEvicted))
        return false;
    oldest->evicted = true;
    ++evicted;
    ::shutdown(oldest->fd.get(), SHUT_RDWR);  // its thread wakes and ends; the reaper closes it
    return true;
}

bool DataServer::Impl::send_error(int fd, uint64_t request_id, frame::ErrorCode code,
                                  const std::string& text, ssl_st* ssl) {
    const uint32_t size = uint32_t(std::min<size_t>(text.size(), frame::kMaxErrorMessageBytes));
    uint8_t header[frame::kHeaderBytes];
    frame::encode_header(frame::error(request_id, code, size), header);
    iovec iov[2] = {{header, sizeof header}, {const_cast<char*>(text.data()), size}};
    net::IoLimits limits;
    limits.wake_fd = wake.get();
    limits.deadline = Clock::now() + std::chrono::seconds(2);
    limits.ssl = ssl;
    ++errors_sent;
    return net::send_all(fd, iov, 2, limits, nullptr) == net::Io::kOk;
}

void DataServer::Impl::send_page_error(int fd, const std::string& kind, const std::string& text,
                                       ssl_st* ssl) {
    std::vector<uint8_t> body;
    const auto append = [&body](const void* p, size_t n) {
        body.insert(body.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
    };
    const uint16_t kind_bytes = uint16_t(kind.size());
    const uint32_t text_bytes = uint32_t(text.size());
    append(&kind_bytes, 2);
    append(kind.data(), kind.size());
    append(&text_bytes, 4);
    append(text.data(), text.size());
    uint8_t header[8] = {kPageProtocolVersion, 1, 0, 0};
    const uint32_t size = uint32_t(body.size());
    std::memcpy(header + 4, &size, 4);
    iovec iov[2] = {{header, sizeof header}, {body.data(), body.size()}};
    net::IoLimits limits;
    limits.wake_fd = wake.get();
    limits.deadline = Clock::now() + std::chrono::seconds(2);
    limits.ssl = ssl;
    ++errors_sent;
    if (net::send_all(fd, iov, 2, limits, nullptr) == net::Io::kOk)
        net::finish_sending(fd, 1000);  // the caller reads the reason before the close
}

uint64_t DataServer::Impl::received_end(uint64_t offset) const {
    auto it = growing.upper_bound(offset);
    if (it == growing.begin()) return UINT64_MAX;
    --it;
    if (offset >= it->first + it->second.length_bytes) return UINT64_MAX;
    return it->first + it->second.received_bytes;
}

frame::ErrorCode DataServer::Impl::check_read(uint64_t ticket_id, uint64_t offset,
                                              uint64_t length_bytes, bool* ok) {
    *ok = false;
    std::unique_lock<std::mutex> lock(tickets_mutex);
    const auto give_up = Clock::now() + std::chrono::milliseconds(kGrowingWaitMs);
    for (;;) {
        const auto it = tickets.find(ticket_id);
        if (it == tickets.end()) return frame::ErrorCode::kBadTicket;
        const auto now = Clock::now();
        if (it->second.expires <= now) {
            tickets.erase(it);
            return frame::ErrorCode::kBadTicket;
        }
        Ticket& t = it->second;
        // The frame parser guarantees offset + length does not overflow.
        if (offset < t.offset || offset + length_bytes > t.offset + t.length_bytes)
            return frame::ErrorCode::kOutOfRange;
        // A range still being received (a relay in a chain): serve what has arrived.
        if (received_end(offset) >= offset + length_bytes) {
            t.last_used = now;
            *ok = true;
            return frame::ErrorCode::kProtocol;
        }
        t.last_used = now;  // a waiting reader is not an idle one
        if (stopping || now >= give_up) return frame::ErrorCode::kBusy;
        tickets_changed.wait_until(lock, std::min(give_up, t.expires));
    }
}

void DataServer::Impl::serve(Connection* connection) {
    const int fd = connection->fd.get();
    net::IoLimits limits;
    limits.wake_fd = wake.get();
    limits.spin_us = net::kRecvSpinUs;  // a pooled connection's next request often follows at once
    bool authenticated = false;
    const auto connected_at = Clock::now();
    uint8_t raw[frame::kHeaderBytes];
    uint8_t token_bytes[frame::kMaxTokenBytes];
    if (tls) {
        limits.deadline = connected_at + std::chrono::milliseconds(kHandshakeTimeoutMs);
        // A plaintext client's first byte is a frame's, not a TLS record's (22): tell it, in
        // plaintext, why nothing will work, instead of a failed handshake it cannot explain.
        uint8_t first = 0;
        if (net::wait_ready(fd, POLLIN, limits, connected_at) != net::Io::kOk) return;
        if (::recv(fd, &first, 1, MSG_PEEK) == 1 && first != 22) {
            const char* text =
                "this data server speaks TLS only: give the client the cluster's TLS files";
            if (first == kPageProtocolVersion)
                send_page_error(fd, "Unavailable", text, nullptr);
            else
                send_error(fd, 0, frame::ErrorCode::kNotAuthenticated, text);
            return;
        }
        if (!tls::handshake(fd, tls.get(), true, "", limits, &connection->session).empty())
            return;
        limits.ssl = connection->session.get();
    }

    bool first_frame = true;
    for (;;) {
        // Read one header: handshake deadline first, then an idle timeout.
        limits.deadline = authenticated
                              ? Clock::now() + std::chrono::milliseconds(kIdleTimeoutMs)
                              : connected_at + std::chrono::milliseconds(kHandshakeTimeoutMs);
        limits.stall_ms = 0;
        if (first_frame) {
            // A page client's first frame is a page header (8 bytes, its first byte the page
            // protocol's version; ours starts with "TCDP"): that connection belongs to the
            // worker's remote page service.
            first_frame = false;
            constexpr size_t kPageHeader = 8;
            if (net::recv_all(fd, raw, kPageHeader, limits, nullptr) != net::Io::kOk) return;
            if (raw[0] == kPageProtocolVersion) {
                std::shared_ptr<RemotePageService> service;
                {
                    std::lock_guard<std::mutex> lock(pages_mutex);
                    service = pages;
                }
                if (!service) {
                    send_page_error(fd, "Unavailable", "this data port serves no KV pages",
                                    limits.ssl);
                    return;
                }
                // Idle page connections are evictable like data ones (make_room).
                const RemotePageService::IdleMark mark{
                    [connection] {
                        connection->idle_since = Clock::now().time_since_epoch().count();
                        connection->idle = kWaiting;
                    },
                    [connection] { return connection->idle.exchange(kBusy) != kEvicted; }};
                service->serve(fd, limits.ssl, raw, wake.get(), mark);
                return;
            }
            if (net::recv_all(fd, raw + kPageHeader, sizeof raw - kPageHeader, limits, nullptr) !=
                net::Io::kOk)
                return;
        } else {
            if (authenticated) {
                connection->idle_since = Clock::now().time_since_epoch().count();
                connection->idle = kWaiting;
            }
            const net::Io io = net::recv_all(fd, raw, sizeof raw, limits, nullptr);
            // Evicted while waiting: the socket is shut, even if a READ slipped in.
            if (connection->idle.exchange(kBusy) == kEvicted || io != net::Io::kOk) return;
        }
        frame::Header h;
        const frame::Status status = frame::decode_header(raw, sizeof raw, &h);
        if (status != frame::Status::kOk) {
            send_error(fd, 0, frame::ErrorCode::kProtocol, frame::status_name(status), limits.ssl);
            return;
        }
        if (!authenticated) {
            if (h.type != frame::Type::kHello) {
                send_error(fd, h.request_id, frame::ErrorCode::kNotAuthenticated,
                           "HELLO expected first", limits.ssl);
                return;
            }
            if (net::recv_all(fd, token_bytes, h.payload_bytes, limits, nullptr) != net::Io::kOk)
                return;
            if (!net::token_accepted(token, token_bytes, h.payload_bytes)) {
                send_error(fd, h.request_id, frame::ErrorCode::kBadToken, "bad token", limits.ssl);
                return;
            }
            uint8_t reply[frame::kHeaderBytes];
            frame::Header ok = frame::hello_ok();
            ok.request_id = h.request_id;
            frame::encode_header(ok, reply);
            iovec iov{reply, sizeof reply};
            limits.stall_ms = kSendStallTimeoutMs;
            limits.deadline = Clock::time_point::max();
            if (net::send_all(fd, &iov, 1, limits, nullptr) != net::Io::kOk) return;
            authenticated = true;
            continue;
        }
        if (h.type != frame::Type::kRead) {
            send_error(fd, h.request_id, frame::ErrorCode::kProtocol, "READ expected", limits.ssl);
            return;
        }
        bool allowed = false;
        const frame::ErrorCode code = check_read(h.a, h.b, h.c, &allowed);
        if (!allowed) {
            if (code == frame::ErrorCode::kBusy) {  // the relay's own pull stalled: give up here
                send_error(fd, h.request_id, code, "range not received by this relay in time",
                           limits.ssl);
                return;
            }
            const char* text = code == frame::ErrorCode::kBadTicket
                                   ? "unknown or expired ticket"
                                   : "range outside the ticket";
            if (!send_error(fd, h.request_id, code, text, limits.ssl)) return;
            continue;
        }
        // Straight from the pool: header and payload leave in one sendmsg.
        const uint8_t* payload = base + h.b;
        uint64_t checksum = xxh::hash64(payload, size_t(h.c));
        if (take_one(corrupt_countdown) != 0) checksum ^= 1;
        uint8_t header[frame::kHeaderBytes];
        frame::encode_header(frame::data(h.request_id, h.b, h.c, checksum), header);
        iovec iov[2] = {{header, sizeof header},
                        {const_cast<uint8_t*>(payload), size_t(h.c)}};
        limits.stall_ms = kSendStallTimeoutMs;
        limits.deadline = Clock::time_point::max();
        if (net::send_all(fd, iov, 2, limits, nullptr) != net::Io::kOk) return;
        bytes_sent += h.c;
        ++chunks_sent;
        if (take_one(close_countdown) == 1) {
            // Abort (RST, not FIN) to look like a crashed source.
            const linger hard{1, 0};
            ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &hard, sizeof hard);
            connection->fd.reset();
            return;
        }
    }
}

}  // namespace tc
