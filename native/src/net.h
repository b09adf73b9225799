// Internal: small POSIX socket helpers for the data plane. Every wait is a
// poll() bounded by a deadline and also woken by a "wake" eventfd, which the
// owner writes once to stop all its threads (it stays readable afterwards).
#pragma once

#include <sys/socket.h>
#include <sys/uio.h>

#include <chrono>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <vector>

struct ssl_st;

namespace tc::net {

using Clock = std::chrono::steady_clock;

// Owns a file descriptor; move-only.
class Fd {
public:
    Fd() = default;
    explicit Fd(int fd) : fd_(fd) {}
    Fd(Fd&& other) noexcept : fd_(other.release()) {}
    Fd& operator=(Fd&& other) noexcept {
        if (this != &other) reset(other.release());
        return *this;
    }
    Fd(const Fd&) = delete;
    Fd& operator=(const Fd&) = delete;
    ~Fd() { reset(); }

    int get() const { return fd_; }
    bool valid() const { return fd_ >= 0; }
    int release() {
        const int fd = fd_;
        fd_ = -1;
        return fd;
    }
    void reset(int fd = -1);

private:
    int fd_ = -1;
};

struct Address {
    sockaddr_storage storage{};
    socklen_t size_bytes = 0;
    int family = 0;
};

// getaddrinfo for TCP; throws IoError (passive) or returns an empty vector.
std::vector<Address> resolve(const std::string& host, uint16_t port, bool passive,
                             std::string* error);
std::string describe(const std::string& host, uint16_t port);

// Non-blocking eventfd used as the wake signal.
Fd make_wake_fd();
// True if `given` equals one of the comma-separated tokens in `accepted` (a server accepts two
// while the cluster token rotates). Constant time in the tokens' contents.
bool token_accepted(const std::string& accepted, const uint8_t* given, size_t given_bytes);

void signal_wake(int wake_fd);
bool is_woken(int wake_fd);

void set_nonblocking(int fd);
// TCP_NODELAY (frames are written whole, Nagle only adds latency to READs)
// and SO_SNDBUF/SO_RCVBUF if the system allows the size we want.
void tune_socket(int fd);

enum class Wait { kReady, kWoken, kTimeout };
// Waits for `events` on fd (error/hang-up count as ready: the next call reports
// them), for wake_fd to become readable, or for the deadline.
Wait wait_for(int fd, short events, int wake_fd, Clock::time_point deadline);

enum class Io { kOk, kWoken, kTimeout, kClosed, kError };
const char* io_name(Io io);

// How long the data plane's receivers watch a socket before sleeping (see IoLimits::spin_us).
constexpr int kRecvSpinUs = 50;

struct IoLimits {
    int wake_fd = -1;
    Clock::time_point deadline = Clock::time_point::max();
    int stall_ms = 0;  // > 0: also fail if no byte moves for this long
    uint64_t max_piece_bytes = 0;  // > 0: recv at most this much per call
    // > 0: when nothing is there to read, watch the socket this long (yielding the CPU) before
    // sleeping in poll(). Waking a sleeping thread costs tens of microseconds; callers that
    // expect bytes soon (a reply, the rest of a stream) trade a little CPU for that latency.
    int spin_us = 0;
    // Non-null: the connection is TLS and its bytes go through this session (see tls.h).
    ssl_st* ssl = nullptr;
};

// After a final error reply: stop sending (FIN after the reply) and read whatever the peer still
// sends until it closes or `wait_ms` passes. Closing with unread bytes would send a reset, and a
// reset can destroy the reply before the peer reads it.
void finish_sending(int fd, int wait_ms);

// Waits until fd has `events` within the limits (deadline, stall since last_progress, wake_fd):
// kOk when it has, else kTimeout / kWoken.
Io wait_ready(int fd, short events, const IoLimits& limits, Clock::time_point last_progress);

// Sends every byte of iov (modified in place). *error gets errno on kError.
Io send_all(int fd, iovec* iov, int iov_count, const IoLimits& limits, int* error);

// Receives exactly size_bytes into dest, calling on_bytes(ptr, n) for each
// piece as it lands (while it is still in cache).
template <typename OnBytes>
Io recv_all(int fd, uint8_t* dest, uint64_t size_bytes, const IoLimits& limits, int* error,
            OnBytes&& on_bytes);

Io recv_all(int fd, uint8_t* dest, uint64_t size_bytes, const IoLimits& limits, int* error);

// Template body: needs recv/errno only.
Io recv_step(int fd, uint8_t* dest, uint64_t size_bytes, const IoLimits& limits,
             Clock::time_point* last_progress, uint64_t* received, int* error);

template <typename OnBytes>
Io recv_all(int fd, uint8_t* dest, uint64_t size_bytes, const IoLimits& limits, int* error,
            OnBytes&& on_bytes) {
    Clock::time_point last_progress = Clock::now();
    uint64_t done = 0;
    while (done < size_bytes) {
        uint64_t received = 0;
        const Io io = recv_step(fd, dest + done, size_bytes - done, limits, &last_progress,
                                &received, error);
        if (io != Io::kOk) return io;
        if (received > 0) on_bytes(dest + done, received);
        done += received;
    }
    return Io::kOk;
}

// Thread-per-connection servers (data server, page server) keep their connections in a list;
// each has a `thread` and sets `finished` when it is done. Call with the list's lock held.
template <typename Connection>
void reap_finished(std::list<std::unique_ptr<Connection>>& connections) {
    for (auto it = connections.begin(); it != connections.end();) {
        if ((*it)->finished) {
            (*it)->thread.join();
            it = connections.erase(it);  // closes its fd, after its thread is gone
        } else {
            ++it;
        }
    }
}

// Joins every connection's thread (the server's wake fd told them to stop) and drops them.
template <typename Connection>
void join_all(std::list<std::unique_ptr<Connection>>& connections) {
    for (auto& connection : connections)
        if (connection->thread.joinable()) connection->thread.join();
    connections.clear();
}

}  // namespace tc::net
