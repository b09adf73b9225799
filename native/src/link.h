// Internal: authenticated data-port connections kept for reuse, shared by pulls (pull.cpp) and
// remote page calls (page_remote.cpp), and the connect step they share.
#pragma once

#include <poll.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "net.h"
#include "tls.h"

namespace tc::net {

// An authenticated connection to a data port (TLS ones carry their session).
struct Link {
    Fd fd;
    tls::Session session;
    uint64_t info = 0;  // what the server said at HELLO (page links: its pool's size)
};

// Links left idle by finished calls, kept for the next call to the same server: no connect,
// no HELLO, and a congestion window that has already grown. The age limit stays below the
// data server's idle timeout (1 min), so a pooled link is rarely stale; a full server may still
// close one early (take() sees that).
class LinkPool {
public:
    static constexpr int kIdleMs = 30'000;
    static constexpr size_t kMaxPerServer = 8;
    static constexpr size_t kMaxServers = 64;

    std::optional<Link> take(const std::string& key) {
        std::lock_guard<std::mutex> lock(mutex_);
        const auto it = idle_.find(key);
        if (it == idle_.end()) return std::nullopt;
        auto& list = it->second;
        const auto oldest = Clock::now() - std::chrono::milliseconds(kIdleMs);
        std::optional<Link> found;
        while (!list.empty() && !found) {
            Idle idle = std::move(list.back());
            list.pop_back();
            if (idle.since > oldest && still_open(idle.link.fd.get()))
                found = std::move(idle.link);
        }
        if (list.empty()) idle_.erase(it);
        return found;
    }

    void give(const std::string& key, Link link) {
        std::lock_guard<std::mutex> lock(mutex_);
        // Links too old to be taken go now, whatever their server: one never asked again
        // would otherwise keep its socket open here for the life of the process.
        const auto oldest = Clock::now() - std::chrono::milliseconds(kIdleMs);
        for (auto it = idle_.begin(); it != idle_.end();) {
            auto& links = it->second;
            links.erase(std::remove_if(links.begin(), links.end(),
                                       [&](const Idle& idle) { return idle.since <= oldest; }),
                        links.end());
            it = links.empty() ? idle_.erase(it) : std::next(it);
        }
        auto& list = idle_[key];
        if (list.size() >= kMaxPerServer || idle_.size() > kMaxServers) {
            if (list.empty()) idle_.erase(key);
            return;  // the connection closes here
        }
        list.push_back(Idle{std::move(link), Clock::now()});
    }

private:
    struct Idle {
        Link link;
        Clock::time_point since;
    };

    // An idle connection must have nothing to read: readable means the server closed it (EOF)
    // or sent something unexpected; either way it is not reusable.
    static bool still_open(int fd) {
        pollfd p{fd, POLLIN, 0};
        return ::poll(&p, 1, 0) == 0;
    }

    std::mutex mutex_;
    std::unordered_map<std::string, std::vector<Idle>> idle_;
};

inline LinkPool& link_pool() {
    static LinkPool* pool = new LinkPool();  // never destroyed: safe at exit
    return *pool;
}

// Connects a non-blocking, tuned TCP socket to the first of `addresses` that accepts, within
// `deadline` (woken by `wake_fd`). On failure returns an invalid Fd and sets *wait (kTimeout /
// kWoken) or *error (errno of the last attempt).
Fd connect_any(const std::vector<Address>& addresses, Clock::time_point deadline, int wake_fd,
               Wait* wait, int* error);

}  // namespace tc::net
