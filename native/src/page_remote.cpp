#include "tensorcast/page_remote.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

#include "link.h"
#include "net.h"
#include "page_wire.h"
#include "parallel.h"
#include "tensorcast/errors.h"
#include "tensorcast/hash.h"
#include "tensorcast/page_server.h"
#include "tls.h"

namespace tc {
namespace {

using net::Clock;
using page_wire::Reader;
using page_wire::Writer;
using std::chrono::milliseconds;

constexpr size_t kHeaderBytes = page_wire::kHeaderBytes;
constexpr int kBodyStallMs = 10'000;   // a request's body and bytes must keep arriving
constexpr int kHelloWithinMs = 10'000;  // a new connection authenticates this soon, or is closed
constexpr uint64_t kMinPutBytesPerS = 8ull << 20;  // a PUT's bytes arrive at least this fast
constexpr int kIdleTimeoutMs = 300'000;  // as the data server's: no request for this long
constexpr int kSendStallMs = 30'000;   // the caller stopped reading
constexpr int kServerSpinUs = 100;     // watch for the next request before sleeping
constexpr int kClientSpinUs = 100;     // watch for the reply before sleeping
constexpr uint32_t kMaxErrorBytes = 4096;
constexpr int kCloseWaitMs = 1000;     // after a final error reply, for the caller to read it
constexpr uint32_t kMaxReplyBytes = 64u << 20;
constexpr uint64_t kPieceBytes = 256 << 10;  // received and hashed at a time, still in cache
constexpr size_t kMinPagesPerPart = 8;        // a get splits over connections above this
constexpr uint64_t kMinPartBytes = 1ull << 20;  // a put splits over connections above this
constexpr size_t kMaxDtypeBytes = 64;

// Every lease a PUT writes under. Token 0 ("any copy") is for reads: a write naming it is
// checked like any other token, so it is refused (nobody holds a lease under token 0).
std::vector<std::pair<uint32_t, uint64_t>> write_leases(const std::vector<PageWrite>& pages) {
    std::set<std::pair<uint32_t, uint64_t>> named;
    for (const auto& p : pages) named.emplace(p.shard, p.token);
    return {named.begin(), named.end()};
}

std::vector<std::pair<uint32_t, uint64_t>> named_leases(const std::vector<PageKey>& keys) {
    std::set<std::pair<uint32_t, uint64_t>> named;
    for (const auto& k : keys)
        if (k.token != 0) named.emplace(k.shard, k.token);
    return {named.begin(), named.end()};
}

void put_header(uint8_t* header, uint8_t op_or_status, uint32_t body_bytes) {
    header[0] = kPageProtocolVersion;
    header[1] = op_or_status;
    header[2] = header[3] = 0;
    std::memcpy(header + 4, &body_bytes, 4);
}

// Takes one unit from a countdown; true when there was one.
bool take_countdown(std::atomic<uint32_t>& counter) {
    uint32_t value = counter.load();
    while (value != 0 && !counter.compare_exchange_weak(value, value - 1)) {
    }
    return value != 0;
}

std::vector<uint8_t> error_body(const std::string& kind, const std::string& message) {
    Writer error;
    error.str(kind);
    const size_t n = std::min<size_t>(message.size(), kMaxErrorBytes);
    error.number(uint32_t(n));
    error.out.insert(error.out.end(), message.begin(), message.begin() + long(n));
    return error.out;
}

}  // namespace

// -- the worker's end ------------------------------------------------------------------------

struct RemotePageService::Connection {
    int fd;
    ssl_st* ssl;
    int wake_fd;
    bool authenticated = false;
    bool keep = true;  // false: close after the reply in progress

    net::IoLimits limits(int stall_ms) const {
        net::IoLimits l;
        l.wake_fd = wake_fd;
        l.stall_ms = stall_ms;
        l.ssl = ssl;
        return l;
    }
    bool send(uint8_t status, const std::vector<uint8_t>& body) {
        uint8_t header[kHeaderBytes];
        put_header(header, status, uint32_t(body.size()));
        iovec iov[2] = {{header, kHeaderBytes}, {const_cast<uint8_t*>(body.data()), body.size()}};
        return net::send_all(fd, iov, 2, limits(kSendStallMs), nullptr) == net::Io::kOk;
    }
    // Reads and discards `size_bytes` (the bytes of a request refused after its header).
    bool drain(uint64_t size_bytes) {
        std::vector<uint8_t> scratch(std::min<uint64_t>(size_bytes, kPieceBytes));
        while (size_bytes > 0) {
            const uint64_t n = std::min<uint64_t>(size_bytes, scratch.size());
            if (net::recv_all(fd, scratch.data(), n, limits(kBodyStallMs), nullptr) !=
                net::Io::kOk)
                return false;
            size_bytes -= n;
        }
        return true;
    }
};

// Thrown by handlers after they answered: the connection cannot go on (I/O failed mid-way).
struct ConnectionOver {};

RemotePageService::RemotePageService(std::shared_ptr<PageIndex> index, std::string token,
                                     uint64_t arena_bytes)
    : index_(std::move(index)), token_(std::move(token)), arena_bytes_(arena_bytes) {
    if (token_.empty()) throw std::invalid_argument("RemotePageService: empty token");
}

RemotePageStats RemotePageService::stats() const {
    return {requests_, errors_sent_, bytes_received_, bytes_sent_, active_};
}

void RemotePageService::serve(int fd, ssl_st* ssl, const uint8_t* first_header, int wake_fd,
                              const IdleMark& mark) {
    ++active_;
    struct Active {
        std::atomic<uint64_t>& n;
        ~Active() { --n; }
    } active{active_};
    Connection c{fd, ssl, wake_fd};
    uint8_t header[kHeaderBytes];
    std::memcpy(header, first_header, kHeaderBytes);
    bool have_header = true;
    const auto connected_at = Clock::now();
    std::vector<uint8_t> body;
    for (;;) {
        if (!have_header) {
            net::IoLimits idle = c.limits(0);
            idle.deadline = c.authenticated ? Clock::now() + milliseconds(kIdleTimeoutMs)
                                            : connected_at + milliseconds(kHelloWithinMs);
            idle.spin_us = kServerSpinUs;
            const bool markable = c.authenticated && mark.waiting && mark.busy;
            if (markable) mark.waiting();
            const net::Io io = net::recv_all(fd, header, kHeaderBytes, idle, nullptr);
            // Evicted while waiting: the socket is shut, even if a request slipped in.
            if ((markable && !mark.busy()) || io != net::Io::kOk) return;
        }
        have_header = false;
        uint32_t size;
        std::memcpy(&size, header + 4, 4);
        try {
            // A bad header leaves the stream unreadable: answer, then close.
            c.keep = false;
            if (header[0] != kPageProtocolVersion || header[2] != 0 || header[3] != 0)
                throw StatusError("InvalidArgument",
                                  "page protocol version " + std::to_string(header[0]) +
                                      " or reserved bytes set; this worker speaks version " +
                                      std::to_string(kPageProtocolVersion));
            if (size > kMaxPageRequestBytes)
                throw StatusError("InvalidArgument", "page request of " + std::to_string(size) +
                                                         " bytes, the limit is " +
                                                         std::to_string(kMaxPageRequestBytes));
            // Before HELLO nothing else is read (not even a WAKE, which would keep an
            // unauthenticated connection open).
            if (!c.authenticated && header[1] != page_wire::kHello)
                throw StatusError("Unauthenticated", "say HELLO with the token first");
            body.resize(size);
            net::IoLimits limits = c.limits(kBodyStallMs);
            if (!c.authenticated)  // HELLO comes at once, or not at all
                limits.deadline = connected_at + milliseconds(kHelloWithinMs);
            if (net::recv_all(fd, body.data(), size, limits, nullptr) != net::Io::kOk) return;
            c.keep = true;
            if (header[1] == page_wire::kWake && size == 0) continue;
            ++requests_;
            // A body that does not parse closes the connection too (a caller that sends one is
            // broken); handlers keep it once their request parsed.
            c.keep = false;
            handle(c, header[1], body);
        } catch (const StatusError& e) {
            ++errors_sent_;
            c.send(1, error_body(e.kind, e.what()));
            if (!c.keep || !c.authenticated) {
                net::finish_sending(fd, kCloseWaitMs);
                return;
            }
        } catch (const ConnectionOver&) {
            return;
        }
    }
}

void RemotePageService::handle(Connection& c, uint8_t op, const std::vector<uint8_t>& body) {
    using namespace page_wire;
    if (op == kHello) {
        Reader in(body.data(), body.size());
        const std::string given = in.str();
        in.end();
        c.keep = true;
        if (!net::token_accepted(token_, reinterpret_cast<const uint8_t*>(given.data()),
                                 given.size()))
            throw StatusError("Unauthenticated", "missing or wrong cluster token");
        c.authenticated = true;
        Writer out;
        out.number(arena_bytes_);
        if (!c.send(0, out.out)) throw ConnectionOver{};
        return;
    }
    if (!c.authenticated) throw StatusError("Unauthenticated", "say HELLO with the token first");
    switch (op) {
        case kExists: {
            Reader in(body.data(), body.size());
            const auto keys = read_keys(in);
            c.keep = true;
            index_->check_leases(named_leases(keys));
            const auto found = index_->lookup(keys);
            Writer out;
            out.number(uint32_t(found.size()));
            for (const auto& page : found) out.number(uint8_t(page.has_value()));
            if (!c.send(0, out.out)) throw ConnectionOver{};
            return;
        }
        case kRead:
            read(c, body);
            return;
        case kPut:
            put(c, body);
            return;
        default:
            throw StatusError("InvalidArgument",
                              "page operation " + std::to_string(op) +
                                  " is not served on the data port (remote callers READ, PUT "
                                  "and EXISTS)");
    }
}

void RemotePageService::read(Connection& c, const std::vector<uint8_t>& body) {
    Reader in(body.data(), body.size());
    const auto keys = page_wire::read_keys(in);
    c.keep = true;
    index_->check_leases(named_leases(keys));
    auto found = index_->lookup(keys, /*read=*/true);  // renews each page it sends
    Writer meta;
    meta.number(uint32_t(found.size()));
    std::vector<iovec> iov;
    iov.reserve(found.size() + 2);
    uint8_t header[kHeaderBytes];
    iov.push_back({header, kHeaderBytes});
    iov.push_back({nullptr, 0});  // the body, once written
    uint64_t payload = 0;
    for (auto& page : found) {
        if (page && take_countdown(corrupt_countdown_)) page->hash[0] = page->hash[0] == '0' ? '1' : '0';
        page_wire::write_found(meta, page);
        if (!page) continue;
        // Straight from the pool. A page evicted meanwhile sends other bytes, which fail the
        // caller's hash check: absent, never wrong.
        iov.push_back({index_->base() + page->offset, size_t(page->size_bytes)});
        payload += page->size_bytes;
    }
    if (meta.out.size() > kMaxPageRequestBytes)
        throw StatusError("InvalidArgument", "page reply too large: ask for fewer pages");
    put_header(header, 0, uint32_t(meta.out.size()));
    iov[1] = {meta.out.data(), meta.out.size()};
    if (net::send_all(c.fd, iov.data(), int(iov.size()), c.limits(kSendStallMs), nullptr) !=
        net::Io::kOk)
        throw ConnectionOver{};
    bytes_sent_ += payload;
}

namespace {

// Pool regions a PUT holds while its bytes arrive, and its share of the service's budget of such
// bytes; both given back unless the regions were handed to a commit.
struct PutRegions {
    PutRegions(PageIndex& i, std::atomic<uint64_t>& r) : index(i), receiving(r) {}
    PageIndex& index;
    std::atomic<uint64_t>& receiving;
    uint64_t reserved = 0;
    std::vector<uint64_t> offsets;
    ~PutRegions() {
        if (!offsets.empty()) index.free(offsets);
        receiving -= reserved;
    }
};

}  // namespace

void RemotePageService::put(Connection& c, const std::vector<uint8_t>& body) {
    // Anything wrong in the body closes the connection: the bytes that follow may not be what
    // it declared.
    page_wire::PutRequest request = page_wire::parse_put(
        body.data(), body.size(), std::min(kMaxRemotePutBytes, arena_bytes_ / 2));
    std::vector<PageWrite>& writes = request.pages;
    const uint64_t total = request.total_bytes;
    const auto leases = write_leases(writes);
    c.keep = true;
    {  // regions and budget are given back (or committed) before the reply goes out
    PutRegions held{*index_, receiving_};
    // Refusals before any byte is stored: the bytes are drained and the connection goes on.
    try {
        index_->check_leases(leases);
        // PUTs in flight on all connections hold at most half the pool: slow senders cannot
        // take it all (every page evicted for regions that never fill).
        uint64_t now = receiving_.load();
        do {
            if (now + total > arena_bytes_ / 2)
                throw StatusError("ResourceExhausted",
                                  "this worker is receiving " + std::to_string(now) +
                                      " bytes of other puts: retry later");
        } while (!receiving_.compare_exchange_weak(now, now + total));
        held.reserved = total;
        std::vector<uint64_t> sizes;
        for (const auto& w : writes) sizes.push_back(w.size_bytes);
        held.offsets = index_->allocate(sizes, true);
    } catch (const StatusError&) {
        if (!c.drain(total)) throw ConnectionOver{};
        throw;
    }
    // The bytes must keep coming (stall) and arrive at a minimum rate overall.
    const auto deadline = Clock::now() + milliseconds(kBodyStallMs) +
                          milliseconds(total * 1000 / kMinPutBytesPerS);
    StreamTreeHasher hasher;
    std::string damaged;
    for (size_t i = 0; i < writes.size(); ++i) {
        PageWrite& w = writes[i];
        w.offset = held.offsets[i];
        hasher.reset();
        net::IoLimits limits = c.limits(kBodyStallMs);
        limits.deadline = deadline;
        limits.max_piece_bytes = kPieceBytes;
        const net::Io io = net::recv_all(
            c.fd, index_->base() + w.offset, w.size_bytes, limits, nullptr,
            [&hasher](const uint8_t* piece, uint64_t n) { hasher.update(piece, size_t(n)); });
        if (io != net::Io::kOk) throw ConnectionOver{};
        if (damaged.empty() && hex(hasher.finish()) != w.hash) damaged = w.key;
    }
    bytes_received_ += total;
    if (!damaged.empty())
        throw StatusError("IntegrityError", "page " + damaged +
                                                " arrived damaged (its bytes do not match its "
                                                "hash): nothing of this batch was stored");
    // Checked again now the bytes are here: the lease may have moved while they arrived (its
    // pages handed off and dropped), and a late commit would leave a stale home copy.
    index_->check_leases(leases);
    CommitOptions options;
    options.home = true;
    options.if_absent = request.if_absent;
    options.expires_in_s = request.expires_in_s;  // checked by the commit
    options.check_hashes = false;  // hashed above as the bytes landed
    held.offsets.clear();  // the commit owns the regions now
    index_->commit(writes, request.ttl_s, options);  // frees the regions itself on error
    }
    if (!c.send(0, {})) throw ConnectionOver{};
}

// -- the caller's end ------------------------------------------------------------------------

namespace {

// A failure talking to a home (connect, TLS, I/O, a malformed reply): retried once on a fresh
// connection when it happened on a pooled one.
struct LinkFailed {
    std::string kind;  // Unavailable, DeadlineExceeded
    std::string message;
};

class Caller {
public:
    Caller(const RemoteHome& home, const RemoteOptions& options, Clock::time_point deadline)
        : home_(home),
          options_(options),
          deadline_(deadline),
          where_(net::describe(home.host, home.port)),
          tls_(options.tls.enabled() ? tls::client_context(options.tls) : nullptr),
          key_("pages\n" + where_ + '\n' + options.token + '\n' +
               (options.tls.enabled() ? options.tls.ca + '\n' + options.tls.cert : "")) {}

    // Runs `exchange(link)` on a pooled or fresh link; a pooled link that fails is replaced
    // once. The link goes back to the pool when the exchange left it clean.
    template <typename Exchange>
    void run(Exchange&& exchange) {
        for (int attempt = 0;; ++attempt) {
            std::optional<net::Link> pooled = attempt == 0 ? net::link_pool().take(key_)
                                                            : std::nullopt;
            const bool reused = pooled.has_value();
            net::Link link = reused ? std::move(*pooled) : connect();
            try {
                exchange(link);
            } catch (const LinkFailed& e) {
                if (reused && e.kind == "Unavailable" && Clock::now() < deadline_) continue;
                throw StatusError(e.kind, e.message);
            } catch (const StatusError&) {
                if (clean_) net::link_pool().give(key_, std::move(link));
                throw;
            }
            net::link_pool().give(key_, std::move(link));
            return;
        }
    }

    uint64_t arena_bytes(const net::Link& link) const { return link.info; }

    // One request; returns the reply's body (its status checked: an error reply throws the
    // worker's StatusError). `payload` iovecs follow the body.
    std::vector<uint8_t> call(net::Link& link, uint8_t op, const std::vector<uint8_t>& body,
                              std::vector<iovec> payload = {}) {
        clean_ = false;
        if (body.size() > kMaxPageRequestBytes)
            throw StatusError("InvalidArgument", "page request of " +
                                                     std::to_string(body.size()) +
                                                     " bytes: ask for fewer pages at once");
        uint8_t header[kHeaderBytes];
        put_header(header, op, uint32_t(body.size()));
        payload.insert(payload.begin(), {{header, kHeaderBytes},
                                         {const_cast<uint8_t*>(body.data()), body.size()}});
        int error = 0;
        net::Io io = net::send_all(link.fd.get(), payload.data(), int(payload.size()),
                                   limits(link), &error);
        if (io != net::Io::kOk) fail(io, error, "send");
        uint8_t reply_header[kHeaderBytes];
        net::IoLimits waiting = limits(link);
        waiting.spin_us = kClientSpinUs;
        io = net::recv_all(link.fd.get(), reply_header, kHeaderBytes, waiting, &error);
        if (io != net::Io::kOk) fail(io, error, "receive");
        uint32_t size = 0;
        std::memcpy(&size, reply_header + 4, 4);
        if (reply_header[0] != kPageProtocolVersion || reply_header[1] > 1 ||
            size > kMaxReplyBytes)
            throw LinkFailed{"Unavailable",
                             where_ + " answered with a malformed page frame (is it a "
                                      "TensorCast worker's data port, and of this version?)"};
        std::vector<uint8_t> reply(size);
        io = net::recv_all(link.fd.get(), reply.data(), size, limits(link), &error);
        if (io != net::Io::kOk) fail(io, error, "receive");
        if (reply_header[1] != 0) {
            std::string kind, message;
            try {
                Reader in(reply.data(), reply.size());
                kind = in.str();
                message = in.bytes(in.number<uint32_t>());
            } catch (const StatusError&) {
                throw LinkFailed{"Unavailable", where_ + " sent a malformed error reply"};
            }
            clean_ = true;  // the reply was read whole: the link can serve the next call
            throw StatusError(kind, "page home " + where_ + ": " + message);
        }
        return reply;
    }

    // Receives a READ reply's page bytes into the sink's buffers, checking each page's hash
    // as it lands. Pages whose bytes do not match read as absent.
    void receive_pages(net::Link& link, std::vector<std::optional<PageWrite>>& found,
                       const std::vector<size_t>& indexes, const PageSink& sink) {
        StreamTreeHasher hasher;
        net::IoLimits l = limits(link);
        l.max_piece_bytes = kPieceBytes;
        for (size_t j = 0; j < found.size(); ++j) {
            if (!found[j]) continue;
            const uint64_t size = found[j]->size_bytes;
            uint8_t* dest = nullptr;
            try {
                dest = sink(indexes[j], size);
            } catch (const StatusError&) {
                // Keep the stream aligned: drain what this reply still carries, then refuse.
                uint64_t rest = 0;
                for (size_t k = j; k < found.size(); ++k)
                    if (found[k]) rest += found[k]->size_bytes;
                drain(link, rest);
                clean_ = true;
                throw;
            }
            hasher.reset();
            int error = 0;
            const net::Io io = net::recv_all(
                link.fd.get(), dest, size, l, &error,
                [&hasher](const uint8_t* piece, uint64_t n) { hasher.update(piece, size_t(n)); });
            if (io != net::Io::kOk) fail(io, error, "receive page");
            if (hex(hasher.finish()) != found[j]->hash) found[j].reset();
        }
        clean_ = true;
    }

private:
    net::IoLimits limits(const net::Link& link) const {
        net::IoLimits l;
        l.deadline = deadline_;
        l.ssl = link.session.get();
        return l;
    }

    [[noreturn]] void fail(net::Io io, int error, const char* what) const {
        if (io == net::Io::kTimeout)
            throw LinkFailed{"DeadlineExceeded",
                             "page home " + where_ + ": " + what + " timed out (deadline " +
                                 std::to_string(options_.timeout_ms) + " ms)"};
        throw LinkFailed{"Unavailable", "page home " + where_ + ": " + what + " failed: " +
                                            (error ? std::strerror(error) : net::io_name(io))};
    }

    void drain(net::Link& link, uint64_t size_bytes) {
        std::vector<uint8_t> scratch(std::min<uint64_t>(size_bytes, kPieceBytes));
        int error = 0;
        while (size_bytes > 0) {
            const uint64_t n = std::min<uint64_t>(size_bytes, scratch.size());
            const net::Io io = net::recv_all(link.fd.get(), scratch.data(), n, limits(link), &error);
            if (io != net::Io::kOk) fail(io, error, "receive");
            size_bytes -= n;
        }
    }

    net::Link connect() {
        std::string error_text;
        const auto addresses = net::resolve(home_.host, home_.port, false, &error_text);
        if (addresses.empty()) throw StatusError("Unavailable", error_text);
        net::Wait wait;
        int error = 0;
        net::Link link;
        link.fd = net::connect_any(addresses, deadline_, -1, &wait, &error);
        if (!link.fd.valid()) {
            if (wait == net::Wait::kTimeout)
                throw StatusError("DeadlineExceeded", "connecting to page home " + where_ +
                                                          " timed out");
            throw StatusError("Unavailable", "cannot reach page home " + where_ + ": " +
                                                 std::strerror(error ? error : ECONNREFUSED));
        }
        if (tls_ != nullptr) {
            const std::string failed =
                tls::handshake(link.fd.get(), tls_, false, home_.host, limits(link), &link.session);
            if (!failed.empty())
                throw StatusError("Unavailable",
                                  "TLS with page home " + where_ + " failed: " + failed +
                                      ". Both ends need certificates from one CA (TC_TLS_* or "
                                      "STATE_DIR/tls), or both none");
        }
        Writer hello;
        hello.str(options_.token);
        try {
            const auto reply = call(link, page_wire::kHello, hello.out);
            Reader in(reply.data(), reply.size());
            link.info = in.number<uint64_t>();
            in.end();
        } catch (const LinkFailed& e) {
            throw StatusError(e.kind, e.message);
        }
        return link;
    }

    const RemoteHome& home_;
    const RemoteOptions& options_;
    const Clock::time_point deadline_;
    const std::string where_;
    ssl_ctx_st* const tls_;
    const std::string key_;
    bool clean_ = false;  // the last exchange ended on a message boundary
};

// A share of one home's pages, sent over one connection.
struct Part {
    size_t home;
    std::vector<size_t> pages;
};

// Splits each home's pages into up to `streams` contiguous parts of balanced `weight`.
template <typename Weight>
std::vector<Part> split(const std::vector<RemoteHome>& homes, uint32_t streams,
                        Weight&& weight, uint64_t min_part_weight) {
    std::vector<Part> parts;
    for (size_t h = 0; h < homes.size(); ++h) {
        const auto& pages = homes[h].pages;
        if (pages.empty()) continue;
        uint64_t total = 0;
        for (size_t i : pages) total += weight(i);
        const uint64_t n = std::max<uint64_t>(
            1, std::min<uint64_t>({streams, pages.size(), total / std::max<uint64_t>(1, min_part_weight)}));
        const uint64_t target = (total + n - 1) / n;
        Part part{h, {}};
        uint64_t in_part = 0;
        for (size_t i : pages) {
            if (!part.pages.empty() && in_part >= target && parts.size() + 1 < kMaxRemoteParts) {
                parts.push_back(std::move(part));
                part = Part{h, {}};
                in_part = 0;
            }
            part.pages.push_back(i);
            in_part += weight(i);
        }
        parts.push_back(std::move(part));
    }
    return parts;
}

// Runs every part at once (the calling thread takes the first); a part's failure is recorded
// for its home, the other parts go on.
template <typename RunPart>
std::vector<std::optional<HomeError>> run_parts(const std::vector<Part>& parts, size_t homes,
                                                RunPart&& run_part) {
    std::vector<std::optional<HomeError>> errors(homes);
    std::mutex mutex;
    const auto record = [&](size_t home, std::string kind, std::string message) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!errors[home]) errors[home] = HomeError{std::move(kind), std::move(message)};
    };
    if (parts.empty()) return errors;
    detail::run_workers(unsigned(parts.size()), [&](unsigned p) {
        const Part& part = parts[p];
        try {
            run_part(part);
        } catch (const StatusError& e) {
            record(part.home, e.kind, e.what());
        } catch (const std::bad_alloc&) {
            record(part.home, "ResourceExhausted", "out of memory");
        } catch (const std::exception& e) {
            record(part.home, "Unavailable", e.what());
        }
    });
    return errors;
}

uint32_t streams_of(const RemoteOptions& options) {
    return std::min<uint32_t>(options.streams ? options.streams : kDefaultRemoteStreams,
                              kMaxRemoteParts);
}

Clock::time_point deadline_of(const RemoteOptions& options) {
    if (options.timeout_ms == 0) throw std::invalid_argument("remote pages: timeout_ms must be > 0");
    if (options.token.empty() || options.token.size() > 0xffff)
        throw std::invalid_argument("remote pages: bad token");
    return Clock::now() + milliseconds(options.timeout_ms);
}

void check_indexes(const std::vector<RemoteHome>& homes, size_t count) {
    std::vector<bool> seen(count);
    for (const auto& home : homes)
        for (size_t i : home.pages) {
            if (i >= count || seen[i])
                throw std::invalid_argument("remote pages: a page index is out of range or in "
                                            "two homes");
            seen[i] = true;
        }
}

}  // namespace

RemoteGetResult remote_get(const std::vector<PageKey>& keys, const std::vector<RemoteHome>& homes,
                           const PageSink& sink, const RemoteOptions& options) {
    const auto deadline = deadline_of(options);
    check_indexes(homes, keys.size());
    RemoteGetResult result;
    result.pages.resize(keys.size());
    const auto parts = split(homes, streams_of(options), [](size_t) { return 1; },
                             kMinPagesPerPart);
    result.errors = run_parts(parts, homes.size(), [&](const Part& part) {
        Caller caller(homes[part.home], options, deadline);
        caller.run([&](net::Link& link) {
            // A retry replays the whole part, into the same buffers: what an earlier attempt
            // received is stale (its buffer may hold the retry's bytes, or be a new one).
            for (size_t i : part.pages) result.pages[i].reset();
            for (size_t start = 0; start < part.pages.size(); start += kMaxPageBatch) {
                const size_t end = std::min(part.pages.size(), start + kMaxPageBatch);
                std::vector<PageKey> wanted;
                std::vector<size_t> indexes(part.pages.begin() + long(start),
                                            part.pages.begin() + long(end));
                for (size_t i : indexes) wanted.push_back(keys[i]);
                Writer body;
                page_wire::write_keys(body, wanted);
                const auto reply = caller.call(link, page_wire::kRead, body.out);
                std::vector<std::optional<PageWrite>> found;
                try {
                    Reader in(reply.data(), reply.size());
                    if (in.number<uint32_t>() != wanted.size())
                        throw page_wire::malformed("page count");
                    for (size_t j = 0; j < wanted.size(); ++j) found.push_back(page_wire::read_found(in));
                    in.end();
                } catch (const StatusError& e) {
                    throw LinkFailed{"Unavailable", std::string("malformed page reply: ") + e.what()};
                }
                caller.receive_pages(link, found, indexes, sink);
                for (size_t j = 0; j < indexes.size(); ++j) {
                    if (!found[j]) continue;
                    PageWrite& w = *found[j];
                    w.key = wanted[j].key;
                    w.shard = wanted[j].shard;
                    w.token = wanted[j].token;
                    w.offset = 0;
                    result.pages[indexes[j]] = std::move(w);  // distinct indexes per part
                }
            }
        });
    });
    return result;
}

RemoteExistsResult remote_exists(const std::vector<PageKey>& keys,
                                 const std::vector<RemoteHome>& homes,
                                 const RemoteOptions& options) {
    const auto deadline = deadline_of(options);
    check_indexes(homes, keys.size());
    RemoteExistsResult result;
    std::vector<uint8_t> found(keys.size(), 0);
    const auto parts = split(homes, 1, [](size_t) { return 1; }, 1);
    result.errors = run_parts(parts, homes.size(), [&](const Part& part) {
        Caller caller(homes[part.home], options, deadline);
        caller.run([&](net::Link& link) {
            for (size_t start = 0; start < part.pages.size(); start += kMaxPageBatch) {
                const size_t end = std::min(part.pages.size(), start + kMaxPageBatch);
                std::vector<PageKey> wanted;
                for (size_t j = start; j < end; ++j) wanted.push_back(keys[part.pages[j]]);
                Writer body;
                page_wire::write_keys(body, wanted);
                const auto reply = caller.call(link, page_wire::kExists, body.out);
                try {
                    Reader in(reply.data(), reply.size());
                    if (in.number<uint32_t>() != wanted.size())
                        throw page_wire::malformed("page count");
                    for (size_t j = start; j < end; ++j)
                        found[part.pages[j]] = in.number<uint8_t>() != 0;
                    in.end();
                } catch (const StatusError& e) {
                    throw LinkFailed{"Unavailable", std::string("malformed page reply: ") + e.what()};
                }
            }
        });
    });
    result.found.assign(found.begin(), found.end());
    return result;
}

RemotePutResult remote_put(const std::vector<RemotePagePut>& pages,
                           const std::vector<RemoteHome>& homes, double ttl_s, bool if_absent,
                           const RemoteOptions& options, double expires_in_s) {
    const auto deadline = deadline_of(options);
    check_indexes(homes, pages.size());
    for (const auto& p : pages) {
        if (p.key.size() > kMaxPageKeyBytes || p.dtype.size() > kMaxDtypeBytes ||
            p.shape.size() > 255 || p.size_bytes > kMaxPageBytes ||
            (p.data == nullptr && p.size_bytes > 0))
            throw StatusError("InvalidArgument",
                              "page of " + std::to_string(p.size_bytes) + " bytes, a " +
                                  std::to_string(p.key.size()) + "-byte key, a " +
                                  std::to_string(p.shape.size()) +
                                  "-dimension shape: beyond the page limits (" +
                                  std::to_string(kMaxPageBytes) + " bytes, " +
                                  std::to_string(kMaxPageKeyBytes) + "-byte keys)");
    }
    RemotePutResult result;
    result.hashes.resize(pages.size());
    const auto parts = split(homes, streams_of(options),
                             [&](size_t i) { return pages[i].size_bytes; }, kMinPartBytes);
    result.errors = run_parts(parts, homes.size(), [&](const Part& part) {
        // Hash first (once, whatever retries follow); given hashes are sent as claimed.
        std::vector<std::pair<const uint8_t*, size_t>> unhashed;
        std::vector<size_t> which;
        for (size_t i : part.pages) {
            if (!pages[i].hash.empty()) {
                result.hashes[i] = pages[i].hash;
                continue;
            }
            unhashed.emplace_back(pages[i].data, pages[i].size_bytes);
            which.push_back(i);
        }
        const auto digests = tree_hash_many(unhashed, 1);
        for (size_t k = 0; k < which.size(); ++k) result.hashes[which[k]] = hex(digests[k]);
        Caller caller(homes[part.home], options, deadline);
        caller.run([&](net::Link& link) {
            // Requests of at most kRemoteRequestBytes (and a quarter of the home's pool).
            const uint64_t request_bytes =
                std::max<uint64_t>(1, std::min(kRemoteRequestBytes, caller.arena_bytes(link) / 4));
            size_t start = 0;
            while (start < part.pages.size()) {
                size_t end = start;
                uint64_t bytes = 0;
                while (end < part.pages.size() && end - start < kMaxPageBatch &&
                       (end == start || bytes + pages[part.pages[end]].size_bytes <= request_bytes))
                    bytes += pages[part.pages[end++]].size_bytes;
                Writer body;
                body.number(ttl_s);
                body.number(uint8_t((if_absent ? page_wire::kPutIfAbsent : 0) |
                                    (expires_in_s > 0 ? page_wire::kPutExpiresIn : 0)));
                if (expires_in_s > 0) body.number(expires_in_s);
                body.number(uint32_t(end - start));
                std::vector<iovec> payload;
                for (size_t j = start; j < end; ++j) {
                    const size_t i = part.pages[j];
                    page_wire::write_put(body, pages[i], pages[i].size_bytes, result.hashes[i]);
                    payload.push_back({const_cast<uint8_t*>(pages[i].data),
                                       size_t(pages[i].size_bytes)});
                }
                caller.call(link, page_wire::kPut, body.out, std::move(payload));
                start = end;
            }
        });
    });
    return result;
}

}  // namespace tc
