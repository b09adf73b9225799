#include "net.h"

#include "link.h"
#include "tls.h"

#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "tensorcast/errors.h"

namespace tc::net {
namespace {

// Socket buffer we ask for. On Linux the kernel doubles it; we only set it
// when net.core.[rw]mem_max allows it, because a clamped setting would also
// switch off autotuning and end up smaller than the default.
constexpr int kSocketBufferBytes = 4 << 20;

long read_sysctl(const char* path) {
    FILE* file = std::fopen(path, "r");
    if (file == nullptr) return -1;
    long value = -1;
    if (std::fscanf(file, "%ld", &value) != 1) value = -1;
    std::fclose(file);
    return value;
}

bool buffers_allowed() {
    static const bool allowed =
        read_sysctl("/proc/sys/net/core/rmem_max") >= kSocketBufferBytes &&
        read_sysctl("/proc/sys/net/core/wmem_max") >= kSocketBufferBytes;
    return allowed;
}

}  // namespace

void Fd::reset(int fd) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
}

std::string describe(const std::string& host, uint16_t port) {
    if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
    return host + ":" + std::to_string(port);
}

std::vector<Address> resolve(const std::string& host, uint16_t port, bool passive,
                             std::string* error) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_protocol = IPPROTO_TCP;
    hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
    addrinfo* list = nullptr;
    const std::string service = std::to_string(port);
    const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints,
                                 &list);
    std::vector<Address> addresses;
    if (rc != 0) {
        if (error != nullptr) *error = std::string("cannot resolve ") + describe(host, port) +
                                       ": " + ::gai_strerror(rc);
        return addresses;
    }
    for (addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
        if (ai->ai_addrlen > sizeof(sockaddr_storage)) continue;
        Address address;
        std::memcpy(&address.storage, ai->ai_addr, ai->ai_addrlen);
        address.size_bytes = ai->ai_addrlen;
        address.family = ai->ai_family;
        addresses.push_back(address);
    }
    ::freeaddrinfo(list);
    return addresses;
}

Fd make_wake_fd() {
    const int fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fd < 0) throw IoError(std::string("eventfd failed: ") + std::strerror(errno));
    return Fd(fd);
}

bool token_accepted(const std::string& accepted, const uint8_t* given, size_t given_bytes) {
    bool any = false;
    size_t start = 0;
    while (start <= accepted.size()) {
        size_t end = accepted.find(',', start);
        if (end == std::string::npos) end = accepted.size();
        const size_t length = end - start;
        unsigned diff = length == given_bytes ? 0u : 1u;  // lengths are not secret
        const size_t n = std::max(length, given_bytes);
        for (size_t i = 0; i < n; ++i) {
            const uint8_t x = i < length ? uint8_t(accepted[start + i]) : 0;
            const uint8_t y = i < given_bytes ? given[i] : 0;
            diff |= unsigned(x ^ y);
        }
        any |= length > 0 && diff == 0;  // no early exit: every accepted token is compared
        start = end + 1;
    }
    return any;
}

void signal_wake(int wake_fd) {
    const uint64_t one = 1;
    // Cannot fail short of counter overflow; the fd stays readable either way.
    [[maybe_unused]] const ssize_t n = ::write(wake_fd, &one, sizeof one);
}

bool is_woken(int wake_fd) {
    pollfd p{wake_fd, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
}

void set_nonblocking(int fd) {
    const int flags = ::fcntl(fd, F_GETFL, 0);
    if (flags >= 0) ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

void tune_socket(int fd) {
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (buffers_allowed()) {
        const int size = kSocketBufferBytes;
        ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
        ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
    }
}

Wait wait_for(int fd, short events, int wake_fd, Clock::time_point deadline) {
    for (;;) {
        const auto now = Clock::now();
        if (now >= deadline) return Wait::kTimeout;
        // Cap each poll so a far-off deadline cannot overflow the int timeout.
        const auto left_ms =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count() + 1;
        const int timeout_ms = int(std::min<int64_t>(left_ms, 60'000));
        pollfd fds[2] = {{fd, events, 0}, {wake_fd, POLLIN, 0}};
        const int count = wake_fd >= 0 ? 2 : 1;
        const int rc = ::poll(fds, nfds_t(count), timeout_ms);
        if (rc < 0) {
            if (errno == EINTR) continue;
            return Wait::kReady;  // let the following I/O call report the error
        }
        if (count == 2 && fds[1].revents != 0) return Wait::kWoken;
        if (fds[0].revents != 0) return Wait::kReady;
    }
}

const char* io_name(Io io) {
    switch (io) {
        case Io::kOk: return "ok";
        case Io::kWoken: return "stopped";
        case Io::kTimeout: return "timed out";
        case Io::kClosed: return "closed by peer";
        case Io::kError: return "socket error";
    }
    return "?";
}

namespace {

Clock::time_point effective_deadline(const IoLimits& limits, Clock::time_point last_progress) {
    if (limits.stall_ms <= 0) return limits.deadline;
    return std::min(limits.deadline, last_progress + std::chrono::milliseconds(limits.stall_ms));
}

Io from_wait(Wait wait) { return wait == Wait::kWoken ? Io::kWoken : Io::kTimeout; }

// True once fd is readable (or in error: the next recv reports it) within spin_us.
bool spin_until_readable(int fd, int spin_us) {
    const auto until = Clock::now() + std::chrono::microseconds(spin_us);
    pollfd p{fd, POLLIN, 0};
    do {
        if (::poll(&p, 1, 0) != 0) return true;
        sched_yield();  // let the thread we wait for run if it shares our CPU
    } while (Clock::now() < until);
    return false;
}

}  // namespace

Io wait_ready(int fd, short events, const IoLimits& limits, Clock::time_point last_progress) {
    const Wait wait = wait_for(fd, events, limits.wake_fd, effective_deadline(limits, last_progress));
    return wait == Wait::kReady ? Io::kOk : from_wait(wait);
}

Io send_all(int fd, iovec* iov, int iov_count, const IoLimits& limits, int* error) {
    if (limits.ssl != nullptr) return tls::send_all(limits.ssl, fd, iov, iov_count, limits, error);
    Clock::time_point last_progress = Clock::now();
    while (iov_count > 0) {
        if (iov->iov_len == 0) {
            ++iov;
            --iov_count;
            continue;
        }
        msghdr message{};
        message.msg_iov = iov;
        message.msg_iovlen = size_t(std::min(iov_count, IOV_MAX));  // more is EMSGSIZE
        const ssize_t n = ::sendmsg(fd, &message, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                const Wait wait = wait_for(fd, POLLOUT, limits.wake_fd,
                                           effective_deadline(limits, last_progress));
                if (wait != Wait::kReady) return from_wait(wait);
                continue;
            }
            if (error != nullptr) *error = errno;
            return errno == EPIPE || errno == ECONNRESET ? Io::kClosed : Io::kError;
        }
        last_progress = Clock::now();
        size_t sent = size_t(n);
        while (iov_count > 0 && sent >= iov->iov_len) {
            sent -= iov->iov_len;
            ++iov;
            --iov_count;
        }
        if (iov_count > 0) {
            iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + sent;
            iov->iov_len -= sent;
        }
    }
    return Io::kOk;
}

Io recv_step(int fd, uint8_t* dest, uint64_t size_bytes, const IoLimits& limits,
             Clock::time_point* last_progress, uint64_t* received, int* error) {
    if (limits.ssl != nullptr)
        return tls::recv_step(limits.ssl, fd, dest, size_bytes, limits, last_progress, received,
                              error);
    *received = 0;
    for (;;) {
        if (limits.max_piece_bytes > 0) size_bytes = std::min(size_bytes, limits.max_piece_bytes);
        const ssize_t n = ::recv(fd, dest, size_t(size_bytes), 0);
        if (n > 0) {
            *received = uint64_t(n);
            *last_progress = Clock::now();
            return Io::kOk;
        }
        if (n == 0) return Io::kClosed;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            if (limits.spin_us > 0 && spin_until_readable(fd, limits.spin_us)) continue;
            const Wait wait =
                wait_for(fd, POLLIN, limits.wake_fd, effective_deadline(limits, *last_progress));
            if (wait != Wait::kReady) return from_wait(wait);
            continue;
        }
        if (error != nullptr) *error = errno;
        return errno == ECONNRESET ? Io::kClosed : Io::kError;
    }
}

Io recv_all(int fd, uint8_t* dest, uint64_t size_bytes, const IoLimits& limits, int* error) {
    return recv_all(fd, dest, size_bytes, limits, error, [](const uint8_t*, uint64_t) {});
}

void finish_sending(int fd, int wait_ms) {
    ::shutdown(fd, SHUT_WR);
    const auto deadline = Clock::now() + std::chrono::milliseconds(wait_ms);
    uint8_t scratch[4096];
    for (;;) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                              deadline - Clock::now())
                              .count();
        if (left <= 0) return;
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, int(left)) <= 0) return;
        const ssize_t n = ::recv(fd, scratch, sizeof scratch, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) return;
    }
}

Fd connect_any(const std::vector<Address>& addresses, Clock::time_point deadline, int wake_fd,
               Wait* wait, int* error) {
    *wait = Wait::kReady;
    *error = 0;
    for (const auto& address : addresses) {
        Fd candidate(::socket(address.family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
        if (!candidate.valid()) {
            *error = errno;
            continue;
        }
        tune_socket(candidate.get());  // before connect: the window scale is fixed then
        if (::connect(candidate.get(), reinterpret_cast<const sockaddr*>(&address.storage),
                      address.size_bytes) != 0) {
            if (errno != EINPROGRESS) {
                *error = errno;
                continue;
            }
            const Wait waited = wait_for(candidate.get(), POLLOUT, wake_fd, deadline);
            if (waited != Wait::kReady) {
                *wait = waited;
                return Fd();
            }
            int so_error = 0;
            socklen_t size = sizeof so_error;
            ::getsockopt(candidate.get(), SOL_SOCKET, SO_ERROR, &so_error, &size);
            if (so_error != 0) {
                *error = so_error;
                continue;
            }
        }
        return candidate;
    }
    return Fd();
}

}  // namespace tc::net
