#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "link.h"
#include "net.h"
#include "tls.h"
#include "tensorcast/frame.h"
#include "tensorcast/transport.h"

#include "xxh.h"

namespace tc {
namespace {

using net::Clock;
using std::chrono::milliseconds;

constexpr int kMonitorPeriodMs = 50;         // cancel / deadline check period
constexpr int kReconnectBackoffMs = 100;     // times the reconnect number
constexpr int kIdleWaitMs = 100;             // re-check period of an idle connection
// A connection with READs outstanding that receives nothing for this long is
// treated as dead (a hung or partitioned source that never resets).
constexpr int kReceiveStallMs = 10'000;
// recv() at most this much at a time so each piece is hashed while still in cache.
constexpr uint64_t kRecvPieceBytes = 256 << 10;
constexpr uint64_t kMaxPullChunks = 1 << 20;
using net::Link;

net::LinkPool& connection_pool() { return net::link_pool(); }

// Ends one connection; the chunks it had in flight go back to the queue.
struct ConnectionLost {
    TransferFailure kind;
    std::string message;
    // The source sent nothing for the stall limit (connecting, HELLO, or mid-transfer): it is
    // frozen or cut off, and connecting again (or taking a pooled link to it, which skips the
    // HELLO that would tell) only spends the caller's deadline while other replicas wait.
    bool unanswered = false;
};

// Ends the whole pull (bad token, ticket rejected, deadline): no retry helps.
struct PullFailed {
    TransferFailure kind;
    std::string message;
};

// The pull is already over (another thread failed it, or it completed).
struct PullOver {};

struct Chunk {
    uint64_t offset = 0;  // absolute in the source pool
    uint64_t length_bytes = 0;
    uint32_t retries = 0;
    uint64_t avoid_connection = 0;  // last connection that failed it
};

struct InFlight {
    uint64_t request_id;
    uint32_t chunk;
};

constexpr int64_t kNoChunk = -1;
constexpr int64_t kPullOver = -2;

class Pull {
public:
    Pull(std::vector<net::Address> addresses, std::string host, std::string where,
         const std::string& token, ssl_ctx_st* tls, uint64_t ticket, uint64_t source_offset,
         uint8_t* dest, Clock::time_point deadline, const std::string& tls_identity,
         const std::function<void(uint64_t)>& on_prefix, int stall_ms)
        : addresses_(std::move(addresses)),
          host_(std::move(host)),
          where_(std::move(where)),
          token_(token),
          tls_(tls),
          ticket_(ticket),
          source_offset_(source_offset),
          dest_(dest),
          deadline_(deadline),
          pool_key_(where_ + '\n' + token + '\n' + tls_identity),
          on_prefix_(on_prefix),
          stall_ms_(stall_ms),
          wake_(net::make_wake_fd()) {}

    void add_chunk(uint64_t offset, uint64_t length_bytes) {
        chunks_.push_back(Chunk{offset, length_bytes, 0, 0});
        done_.push_back(false);
        queue_.push_back(uint32_t(chunks_.size() - 1));
        remaining_ = chunks_.size();
    }

    // Caller thread: runs `streams` workers, watches cancel and the deadline,
    // joins every worker, then returns or throws.
    PullStats run(uint32_t streams, const std::atomic<bool>* cancel);
    PullStats finish(Clock::time_point started);  // stats, or the failure as an exception

private:
    void worker();
    void worker_loop();
    // Runs one connection until it dies (returns the loss), or the pull ends.
    std::optional<ConnectionLost> run_connection();
    Link connect_and_hello(uint64_t connection_id);
    void receive_frame(const Link& link, std::vector<InFlight>& in_flight,
                       uint64_t connection_id, XXH3_state_t* hash);
    net::IoLimits limits(const Link& link) const {
        net::IoLimits l;
        l.wake_fd = wake_.get();
        l.deadline = deadline_;
        l.spin_us = net::kRecvSpinUs;
        l.ssl = link.session.get();
        return l;
    }
    [[noreturn]] void throw_io(net::Io io, int error, const char* what);

    int64_t take_chunk(uint64_t connection_id, bool wait);
    void complete_chunk(uint32_t chunk);
    void requeue(uint32_t chunk, uint64_t connection_id, bool checksum,
                 const ConnectionLost& cause);
    bool on_connection_lost(const ConnectionLost& loss);  // true: reconnect
    bool succeeded() {
        std::lock_guard<std::mutex> lock(mutex_);
        return over_ && !failure_;
    }
    void fail(TransferFailure kind, const std::string& message);
    void fail_locked(TransferFailure kind, const std::string& message);

    const std::vector<net::Address> addresses_;
    const std::string host_;  // as the caller named it: what a TLS server's certificate names
    const std::string where_;
    const std::string& token_;
    ssl_ctx_st* const tls_;  // null: plaintext
    const uint64_t ticket_;
    const uint64_t source_offset_;
    uint8_t* const dest_;
    const Clock::time_point deadline_;
    const std::string pool_key_;  // server and token: who may reuse a connection
    const std::function<void(uint64_t)>& on_prefix_;
    const int stall_ms_;  // no byte for this long on a connection that awaits one: it is lost
    net::Fd wake_;  // signalled once the pull is over (success or failure)

    std::mutex mutex_;
    std::condition_variable changed_;
    std::vector<Chunk> chunks_;  // in offset order
    std::vector<bool> done_;     // per chunk: verified
    uint32_t prefix_chunks_ = 0;  // chunks [0, prefix_chunks_) all verified
    std::deque<uint32_t> queue_;
    uint64_t remaining_ = 0;
    uint32_t live_ = 0;       // connections connecting or connected
    uint32_t connected_ = 0;  // connections past HELLO_OK
    uint32_t reconnects_used_ = 0;
    uint64_t next_connection_id_ = 1;
    bool over_ = false;
    std::optional<PullFailed> failure_;
    PullStats stats_;
};

void Pull::fail_locked(TransferFailure kind, const std::string& message) {
    if (!over_) {
        over_ = true;
        failure_ = PullFailed{kind, message};
    }
    changed_.notify_all();
    net::signal_wake(wake_.get());
}

void Pull::fail(TransferFailure kind, const std::string& message) {
    std::lock_guard<std::mutex> lock(mutex_);
    fail_locked(kind, message);
}

int64_t Pull::take_chunk(uint64_t connection_id, bool wait) {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
        if (over_) return kPullOver;
        // Prefer a chunk this connection has not just failed, unless no other
        // connection is up to take it.
        for (auto it = queue_.begin(); it != queue_.end(); ++it) {
            if (chunks_[*it].avoid_connection != connection_id || connected_ <= 1) {
                const uint32_t chunk = *it;
                queue_.erase(it);
                return chunk;
            }
        }
        if (!wait) return kNoChunk;
        changed_.wait_for(lock, milliseconds(kIdleWaitMs));
    }
}

void Pull::complete_chunk(uint32_t chunk) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.chunks;
    stats_.bytes += chunks_[chunk].length_bytes;
    done_[chunk] = true;
    const uint32_t before = prefix_chunks_;
    while (prefix_chunks_ < chunks_.size() && done_[prefix_chunks_]) ++prefix_chunks_;
    if (on_prefix_ && prefix_chunks_ != before) {
        const Chunk& last = chunks_[prefix_chunks_ - 1];
        on_prefix_(last.offset + last.length_bytes - source_offset_);  // under the lock: in order
    }
    if (--remaining_ == 0 && !over_) {
        over_ = true;
        changed_.notify_all();
        net::signal_wake(wake_.get());
    }
}

void Pull::requeue(uint32_t chunk, uint64_t connection_id, bool checksum,
                   const ConnectionLost& cause) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (over_) return;
    Chunk& c = chunks_[chunk];
    ++stats_.retries;
    if (checksum) ++stats_.checksum_failures;
    if (++c.retries > kMaxChunkRetries) {
        fail_locked(checksum ? TransferFailure::kChecksumRetriesExhausted : cause.kind,
                    "chunk at offset " + std::to_string(c.offset) + " failed " +
                        std::to_string(c.retries) + " times; last: " + cause.message);
        return;
    }
    c.avoid_connection = connection_id;
    queue_.push_front(chunk);  // retried first: it is what the tail waits for
    changed_.notify_all();
}

bool Pull::on_connection_lost(const ConnectionLost& loss) {
    std::lock_guard<std::mutex> lock(mutex_);
    --live_;
    changed_.notify_all();  // waiters re-evaluate "only live connection"
    if (over_ || live_ > 0) return false;
    if (reconnects_used_ < kMaxReconnects && !loss.unanswered) {
        ++reconnects_used_;
        ++stats_.reconnects;
        ++live_;
        return true;
    }
    if (loss.unanswered) {
        fail_locked(loss.kind, loss.message + " (every connection lost)");
        return false;
    }
    fail_locked(loss.kind, loss.message + " (every connection lost, " +
                               std::to_string(kMaxReconnects) + " reconnects used)");
    return false;
}

void Pull::throw_io(net::Io io, int error, const char* what) {
    switch (io) {
        case net::Io::kWoken: throw PullOver{};
        case net::Io::kTimeout:
            if (Clock::now() < deadline_)  // a stall, not the pull's deadline
                throw ConnectionLost{TransferFailure::kPeerClosed,
                                     std::string(what) + ": no data for " +
                                         std::to_string(stall_ms_) + " ms",
                                     /*unanswered=*/true};
            throw PullFailed{TransferFailure::kTimeout, "deadline passed"};
        case net::Io::kClosed:
            throw ConnectionLost{TransferFailure::kPeerClosed,
                                 std::string(what) + ": connection closed by the server"};
        default:
            throw ConnectionLost{TransferFailure::kPeerClosed,
                                 std::string(what) + ": " + std::strerror(error)};
    }
}

Link Pull::connect_and_hello(uint64_t connection_id) {
    Link link;
    net::Fd& fd = link.fd;
    int last_error = 0;
    for (const auto& address : addresses_) {
        net::Fd candidate(::socket(address.family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
        if (!candidate.valid()) {
            last_error = errno;
            continue;
        }
        net::tune_socket(candidate.get());  // before connect: the window scale is fixed then
        if (::connect(candidate.get(), reinterpret_cast<const sockaddr*>(&address.storage),
                      address.size_bytes) != 0) {
            if (errno != EINPROGRESS) {
                last_error = errno;
                continue;
            }
            // A SYN nobody answers (host frozen or cut off) costs the stall limit, not the
            // whole deadline: the caller still has time for another replica.
            const net::Wait wait = net::wait_for(
                candidate.get(), POLLOUT, wake_.get(),
                std::min(deadline_, Clock::now() + milliseconds(stall_ms_)));
            if (wait == net::Wait::kWoken) throw PullOver{};
            if (wait == net::Wait::kTimeout) {
                if (Clock::now() >= deadline_)
                    throw PullFailed{TransferFailure::kTimeout, "deadline passed while connecting"};
                last_error = ETIMEDOUT;
                continue;
            }
            int so_error = 0;
            socklen_t size = sizeof so_error;
            ::getsockopt(candidate.get(), SOL_SOCKET, SO_ERROR, &so_error, &size);
            if (so_error != 0) {
                last_error = so_error;
                continue;
            }
        }
        fd = std::move(candidate);
        break;
    }
    if (!fd.valid())
        throw ConnectionLost{TransferFailure::kRefused,
                             "connect: " + std::string(std::strerror(last_error)),
                             last_error == ETIMEDOUT};
    // Every handshake step must hear from the server within the stall limit (a source that
    // accepts in its kernel's backlog but never answers, e.g. a stopped process).
    net::IoLimits handshake = limits(link);
    handshake.stall_ms = stall_ms_;
    if (tls_ != nullptr) {
        const std::string failed =
            tls::handshake(fd.get(), tls_, false, host_, handshake, &link.session);
        if (!failed.empty())
            throw PullFailed{TransferFailure::kTls,
                             failed + " (is " + where_ + " serving without TLS, or with another CA?)"};
    }

    uint8_t header[frame::kHeaderBytes];
    frame::Header hello = frame::hello(uint32_t(token_.size()));
    hello.request_id = connection_id;
    frame::encode_header(hello, header);
    iovec iov[2] = {{header, sizeof header}, {const_cast<char*>(token_.data()), token_.size()}};
    int error = 0;
    handshake.ssl = link.session.get();
    net::Io io = net::send_all(fd.get(), iov, 2, handshake, &error);
    if (io != net::Io::kOk) throw_io(io, error, "HELLO");

    io = net::recv_all(fd.get(), header, sizeof header, handshake, &error);
    if (io != net::Io::kOk) throw_io(io, error, "HELLO reply");
    frame::Header reply;
    const frame::Status status = frame::decode_header(header, sizeof header, &reply);
    if (status != frame::Status::kOk)
        throw ConnectionLost{TransferFailure::kProtocol,
                             std::string("HELLO reply: ") + frame::status_name(status)};
    if (reply.type == frame::Type::kHelloOk) return link;
    if (reply.type != frame::Type::kError)
        throw ConnectionLost{TransferFailure::kProtocol, "HELLO reply: unexpected frame type"};
    char text[frame::kMaxErrorMessageBytes];
    io = net::recv_all(fd.get(), reinterpret_cast<uint8_t*>(text), reply.payload_bytes,
                       limits(link), &error);
    const std::string message = "server says: " +
                                (io == net::Io::kOk ? std::string(text, reply.payload_bytes)
                                                    : std::string("(no message)"));
    switch (frame::ErrorCode(reply.a)) {
        case frame::ErrorCode::kBadToken: throw PullFailed{TransferFailure::kBadToken, message};
        // Our HELLO is always first: the only refusal of it is a TLS-only server's.
        case frame::ErrorCode::kNotAuthenticated: throw PullFailed{TransferFailure::kTls, message};
        case frame::ErrorCode::kBusy: throw ConnectionLost{TransferFailure::kRefused, message};
        default: throw ConnectionLost{TransferFailure::kProtocol, message};
    }
}

void Pull::receive_frame(const Link& link, std::vector<InFlight>& in_flight,
                         uint64_t connection_id, XXH3_state_t* hash) {
    const int fd = link.fd.get();
    uint8_t raw[frame::kHeaderBytes];
    int error = 0;
    net::IoLimits l = limits(link);
    l.stall_ms = stall_ms_;
    net::Io io = net::recv_all(fd, raw, sizeof raw, l, &error);
    if (io != net::Io::kOk) throw_io(io, error, "receive");
    frame::Header h;
    const frame::Status status = frame::decode_header(raw, sizeof raw, &h);
    if (status != frame::Status::kOk)
        throw ConnectionLost{TransferFailure::kProtocol,
                             std::string("bad frame: ") + frame::status_name(status)};
    const auto it = std::find_if(in_flight.begin(), in_flight.end(),
                                 [&](const InFlight& f) { return f.request_id == h.request_id; });

    if (h.type == frame::Type::kError) {
        char text[frame::kMaxErrorMessageBytes];
        io = net::recv_all(fd, reinterpret_cast<uint8_t*>(text), h.payload_bytes, limits(link),
                           &error);
        if (io != net::Io::kOk) throw_io(io, error, "receive");
        const std::string message = "server says: " + std::string(text, h.payload_bytes);
        const auto code = frame::ErrorCode(h.a);
        if (code == frame::ErrorCode::kBadTicket || code == frame::ErrorCode::kOutOfRange)
            throw PullFailed{TransferFailure::kTicketRejected, message};
        throw ConnectionLost{TransferFailure::kProtocol, message};
    }
    if (h.type != frame::Type::kData || it == in_flight.end())
        throw ConnectionLost{TransferFailure::kProtocol,
                             "unexpected frame or request id"};
    const uint32_t chunk = it->chunk;
    const Chunk& c = chunks_[chunk];  // offset/length never change: safe unlocked
    if (h.a != c.offset || h.b != c.length_bytes)
        throw ConnectionLost{TransferFailure::kProtocol,
                             "DATA range differs from the READ"};

    // Straight into the caller's buffer; each piece is hashed as it lands.
    XXH3_64bits_reset(hash);
    l.max_piece_bytes = kRecvPieceBytes;
    io = net::recv_all(fd, dest_ + (c.offset - source_offset_), c.length_bytes, l, &error,
                       [hash](const uint8_t* piece, uint64_t size_bytes) {
                           xxh::update64(hash, piece, size_t(size_bytes));
                       });
    if (io != net::Io::kOk) throw_io(io, error, "receive DATA");
    in_flight.erase(it);
    if (XXH3_64bits_digest(hash) == h.c) {
        complete_chunk(chunk);
    } else {
        requeue(chunk, connection_id, true,
                ConnectionLost{TransferFailure::kChecksumRetriesExhausted,
                               "checksum mismatch"});
    }
}

std::optional<ConnectionLost> Pull::run_connection() {
    uint64_t connection_id;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        connection_id = next_connection_id_++;
    }
    std::vector<InFlight> in_flight;
    in_flight.reserve(kMaxReadsInFlight);
    // Counts this connection in connected_ from HELLO_OK until it ends.
    struct Connected {
        Pull* pull = nullptr;
        ~Connected() {
            if (pull == nullptr) return;
            std::lock_guard<std::mutex> lock(pull->mutex_);
            --pull->connected_;
            pull->changed_.notify_all();
        }
    } connected;
    try {
        std::optional<Link> reused = connection_pool().take(pool_key_);
        Link link = reused ? std::move(*reused) : connect_and_hello(connection_id);
        {
            std::lock_guard<std::mutex> lock(mutex_);
            ++connected_;
            connected.pull = this;
        }
        XXH3_state_t hash;
        uint64_t next_request_id = 1;
        for (;;) {
            // Keep kMaxReadsInFlight READs queued at the server so it never idles.
            uint8_t batch[kMaxReadsInFlight][frame::kHeaderBytes];
            int batch_count = 0;
            while (in_flight.size() < kMaxReadsInFlight) {
                const int64_t taken = take_chunk(connection_id, in_flight.empty());
                if (taken == kPullOver) {
                    // Nothing left in flight on a pull that succeeded: the connection is clean.
                    if (in_flight.empty() && succeeded())
                        connection_pool().give(pool_key_, std::move(link));
                    return std::nullopt;
                }
                if (taken == kNoChunk) break;
                const Chunk& c = chunks_[size_t(taken)];
                const uint64_t request_id = next_request_id++;
                frame::encode_header(frame::read(request_id, ticket_, c.offset, c.length_bytes),
                                     batch[batch_count++]);
                in_flight.push_back(InFlight{request_id, uint32_t(taken)});
            }
            if (batch_count > 0) {
                iovec iov{batch, size_t(batch_count) * frame::kHeaderBytes};
                int error = 0;
                const net::Io io = net::send_all(link.fd.get(), &iov, 1, limits(link), &error);
                if (io != net::Io::kOk) throw_io(io, error, "send READ");
            }
            if (!in_flight.empty()) receive_frame(link, in_flight, connection_id, &hash);
        }
    } catch (const ConnectionLost& loss) {
        for (const InFlight& f : in_flight) requeue(f.chunk, connection_id, false, loss);
        return loss;
    } catch (const PullFailed& failed) {
        fail(failed.kind, failed.message);
    } catch (const PullOver&) {
    }
    return std::nullopt;
}

void Pull::worker() {
    try {
        worker_loop();
    } catch (const std::exception& e) {  // e.g. bad_alloc: fail the pull, never terminate
        fail(TransferFailure::kProtocol, std::string("internal error: ") + e.what());
    }
}

void Pull::worker_loop() {
    for (;;) {
        const std::optional<ConnectionLost> loss = run_connection();
        if (!loss || !on_connection_lost(*loss)) return;
        // Every connection is gone: back off a little before reconnecting.
        uint32_t attempt;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            attempt = reconnects_used_;
        }
        const auto until =
            std::min(deadline_, Clock::now() + milliseconds(kReconnectBackoffMs * attempt));
        pollfd p{wake_.get(), POLLIN, 0};
        while (Clock::now() < until) {
            const auto left = std::chrono::duration_cast<milliseconds>(until - Clock::now());
            if (::poll(&p, 1, int(left.count()) + 1) > 0) break;
        }
    }
}

PullStats Pull::run(uint32_t streams, const std::atomic<bool>* cancel) {
    const auto started = Clock::now();
    stats_.streams = streams;
    live_ = streams;
    if (streams == 1 && cancel == nullptr) {
        // One stream and nothing to watch but the deadline, which every socket wait enforces:
        // no monitor needed, so no thread to start (a small pull is mostly fixed cost).
        worker();
        return finish(started);
    }
    std::vector<std::thread> workers;
    workers.reserve(streams);
    try {
        for (uint32_t i = 0; i < streams; ++i) workers.emplace_back([this] { worker(); });
    } catch (...) {
        // Thread creation failed: stop the ones we have before reporting.
        fail(TransferFailure::kProtocol, "could not start threads");
        for (auto& t : workers) t.join();
        throw;
    }
    {
        std::unique_lock<std::mutex> lock(mutex_);
        while (!over_) {
            const auto now = Clock::now();
            if (cancel != nullptr && cancel->load(std::memory_order_relaxed)) {
                fail_locked(TransferFailure::kCancelled, "pull cancelled");
                break;
            }
            if (now >= deadline_) {
                fail_locked(TransferFailure::kTimeout, "deadline passed");
                break;
            }
            changed_.wait_for(lock, std::min<Clock::duration>(milliseconds(kMonitorPeriodMs),
                                                              deadline_ - now));
        }
    }
    for (auto& t : workers) t.join();
    return finish(started);
}

PullStats Pull::finish(Clock::time_point started) {
    stats_.elapsed_ms = uint64_t(
        std::chrono::duration_cast<milliseconds>(Clock::now() - started).count());
    if (!over_) fail(TransferFailure::kProtocol, "internal error: the pull stopped unfinished");
    if (failure_) {
        const std::string message = "pull from " + where_ + ": " + failure_->message;
        if (failure_->kind == TransferFailure::kTimeout) throw TransferTimeout(message);
        if (failure_->kind == TransferFailure::kCancelled) throw TransferCancelled(message);
        throw TransferError(failure_->kind, message);
    }
    return stats_;
}

}  // namespace

PullStats pull(const std::string& host, uint16_t port, const std::string& token, uint64_t ticket,
               uint64_t source_offset, uint64_t length_bytes, uint8_t* dest, uint32_t streams,
               uint64_t chunk_bytes, uint32_t timeout_ms, const std::atomic<bool>* cancel,
               const TlsFiles& tls, const std::function<void(uint64_t)>& on_prefix,
               uint32_t stall_ms) {
    if (streams == 0) streams = kDefaultPullStreams;
    if (chunk_bytes == 0) chunk_bytes = kDefaultPullChunkBytes;
    if (streams > kMaxPullStreams)
        throw std::invalid_argument("pull: streams must be <= " + std::to_string(kMaxPullStreams));
    if (chunk_bytes > frame::kMaxDataBytes)
        throw std::invalid_argument("pull: chunk_bytes must be <= 64 MiB");
    if (timeout_ms == 0) throw std::invalid_argument("pull: timeout_ms must be > 0");
    if (token.empty() || token.size() > frame::kMaxTokenBytes)
        throw std::invalid_argument("pull: token must be 1..1024 bytes");
    if (source_offset + length_bytes < source_offset)
        throw std::invalid_argument("pull: source range overflows");
    if (dest == nullptr && length_bytes > 0) throw std::invalid_argument("pull: null dest");
    if (length_bytes == 0) return PullStats{};
    // Bounds the per-pull bookkeeping (one small record per chunk).
    if ((length_bytes - 1) / chunk_bytes >= kMaxPullChunks)
        throw std::invalid_argument("pull: chunk_bytes too small for the length (more than " +
                                    std::to_string(kMaxPullChunks) + " chunks)");

    const auto deadline = Clock::now() + milliseconds(timeout_ms);
    std::string error;
    auto addresses = net::resolve(host, port, false, &error);
    if (addresses.empty()) throw TransferError(TransferFailure::kRefused, error);

    ssl_ctx_st* tls_ctx = tls.enabled() ? tls::client_context(tls) : nullptr;
    Pull p(std::move(addresses), host, net::describe(host, port), token, tls_ctx, ticket,
           source_offset, dest, deadline, tls.enabled() ? tls.ca + '\n' + tls.cert : "",
           on_prefix, stall_ms == 0 ? kReceiveStallMs : int(std::min<uint32_t>(stall_ms, 1u << 30)));
    for (uint64_t offset = 0; offset < length_bytes; offset += chunk_bytes)
        p.add_chunk(source_offset + offset, std::min(chunk_bytes, length_bytes - offset));
    const uint64_t chunk_count = (length_bytes + chunk_bytes - 1) / chunk_bytes;
    return p.run(uint32_t(std::min<uint64_t>(streams, chunk_count)), cancel);
}

}  // namespace tc
