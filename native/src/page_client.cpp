#include "tensorcast/page_client.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "net.h"
#include "page_wire.h"
#include "tensorcast/copy.h"
#include "tensorcast/errors.h"
#include "tensorcast/hash.h"
#include "tensorcast/page_server.h"

namespace tc {
namespace {

using page_wire::Reader;
using page_wire::Writer;

constexpr uint32_t kMaxReplyBytes = 64u << 20;
// The worker answers in microseconds and a thread asleep in poll() takes tens of them to wake:
// watch for the reply this long (yielding the CPU) before sleeping.
constexpr int kReplySpinUs = 100;
constexpr size_t kMaxDtypeBytes = 64;
// Before copying a put's pages the client wakes the worker's connection thread (WAKE, no
// reply), unless the worker answered so recently that the thread still watches the socket: a
// thread asleep takes tens of microseconds to wake on a busy or virtualized host, and this way
// that overlaps the copy instead of following the COMMIT. Only for copies shorter than the
// worker's watch (100 us): after a longer one the thread would be asleep again anyway.
constexpr auto kWakeAfter = std::chrono::microseconds(50);
constexpr uint64_t kWakeMaxBytes = 512 << 10;

// Parses a reply with `parse`; a reply that does not parse breaks the connection.
template <typename Parse>
auto parse_reply(std::atomic<bool>& broken, const std::vector<uint8_t>& reply, Parse&& parse) {
    try {
        Reader in(reply.data(), reply.size());
        auto out = parse(in);
        in.end();
        return out;
    } catch (const StatusError& e) {
        broken = true;
        throw StatusError("Unavailable",
                          std::string("malformed reply from the page server: ") + e.what());
    }
}

}  // namespace

PageClient::PageClient(int fd, int timeout_ms) : fd_(fd), timeout_ms_(timeout_ms) {
    if (fd < 0) throw std::invalid_argument("PageClient: bad file descriptor");
    net::set_nonblocking(fd_);
}

PageClient::~PageClient() { close(); }

void PageClient::close() {
    std::lock_guard<std::mutex> lock(call_mutex_);
    if (fd_ < 0) return;
    ::close(fd_);
    fd_ = -1;
    broken_ = true;
}

std::vector<uint8_t> PageClient::call(uint8_t op, const std::vector<uint8_t>& body) {
    if (body.size() > kMaxPageRequestBytes)
        throw StatusError("InvalidArgument", "page request of " + std::to_string(body.size()) +
                                                 " bytes, the limit is " +
                                                 std::to_string(kMaxPageRequestBytes));
    std::lock_guard<std::mutex> lock(call_mutex_);
    if (broken_ || fd_ < 0)
        throw StatusError("Unavailable", "local worker page connection failed earlier or closed");
    const auto fail = [this](const std::string& what) {
        broken_ = true;
        return StatusError("Unavailable", "local worker page connection failed: " + what);
    };
    uint8_t header[page_wire::kHeaderBytes] = {kPageProtocolVersion, op, 0, 0};
    const uint32_t size = uint32_t(body.size());
    std::memcpy(header + 4, &size, 4);
    iovec iov[2] = {{header, sizeof header}, {const_cast<uint8_t*>(body.data()), body.size()}};
    net::IoLimits limits;
    limits.stall_ms = timeout_ms_;
    int error = 0;
    net::Io io = net::send_all(fd_, iov, 2, limits, &error);
    if (io != net::Io::kOk)
        throw fail(std::string("send: ") + (error ? std::strerror(error) : net::io_name(io)));
    ++sent_[op % sent_.size()];
    limits.spin_us = kReplySpinUs;
    uint8_t reply_header[page_wire::kHeaderBytes];
    io = net::recv_all(fd_, reply_header, sizeof reply_header, limits, &error);
    uint32_t reply_size = 0;
    std::memcpy(&reply_size, reply_header + 4, 4);
    if (io == net::Io::kOk &&
        (reply_header[0] != kPageProtocolVersion || reply_size > kMaxReplyBytes))
        throw fail("malformed reply from the page server");
    std::vector<uint8_t> reply(reply_size);
    if (io == net::Io::kOk) io = net::recv_all(fd_, reply.data(), reply_size, limits, &error);
    if (io != net::Io::kOk)
        throw fail(std::string("receive: ") + (error ? std::strerror(error) : net::io_name(io)));
    last_reply_ = net::Clock::now();
    if (reply_header[1] != 0) {
        std::string kind, message;
        try {
            Reader in(reply.data(), reply.size());
            kind = in.str();
            message = in.bytes(in.number<uint32_t>());
        } catch (const StatusError&) {
            throw fail("malformed error reply from the page server");
        }
        throw StatusError(kind, message);
    }
    return reply;
}

uint64_t PageClient::hello(const std::string& token) {
    Writer out;
    out.str(token);
    return parse_reply(broken_, call(page_wire::kHello, out.out),
                       [](Reader& in) { return in.number<uint64_t>(); });
}

std::vector<uint64_t> PageClient::alloc(const std::vector<uint64_t>& sizes) {
    Writer out;
    page_wire::write_offsets(out, sizes);
    return parse_reply(broken_, call(page_wire::kAlloc, out.out), [&sizes](Reader& in) {
        auto offsets = page_wire::read_offsets(in);
        if (offsets.size() != sizes.size()) throw page_wire::malformed("region count");
        return offsets;
    });
}

std::vector<uint64_t> PageClient::commit(double ttl_s, const std::vector<PageWrite>& pages,
                                         const std::vector<uint64_t>& ahead) {
    Writer out;
    out.number(ttl_s);
    out.number(uint32_t(pages.size()));
    for (const auto& w : pages) page_wire::write_page(out, w);
    page_wire::write_offsets(out, ahead);
    return parse_reply(broken_, call(page_wire::kCommit, out.out), [&ahead](Reader& in) {
        auto offsets = page_wire::read_offsets(in);
        if (offsets.size() > ahead.size()) throw page_wire::malformed("region count");
        return offsets;
    });
}

std::vector<std::optional<PageWrite>> PageClient::get(const std::vector<PageKey>& keys) {
    Writer out;
    page_wire::write_keys(out, keys);
    return parse_reply(broken_, call(page_wire::kGet, out.out), [&keys](Reader& in) {
        if (in.number<uint32_t>() != keys.size()) throw page_wire::malformed("page count");
        std::vector<std::optional<PageWrite>> found(keys.size());
        for (size_t i = 0; i < keys.size(); ++i) {
            if (!in.number<uint8_t>()) continue;
            PageWrite w;
            w.key = keys[i].key;
            w.shard = keys[i].shard;
            w.token = keys[i].token;
            w.offset = in.number<uint64_t>();
            w.size_bytes = in.number<uint64_t>();
            w.dtype = in.str();
            w.shape = in.shape();
            w.hash = in.str();
            found[i] = std::move(w);
        }
        return found;
    });
}

std::vector<bool> PageClient::exists(const std::vector<PageKey>& keys) {
    Writer out;
    page_wire::write_keys(out, keys);
    return parse_reply(broken_, call(page_wire::kExists, out.out), [&keys](Reader& in) {
        if (in.number<uint32_t>() != keys.size()) throw page_wire::malformed("page count");
        std::vector<bool> found(keys.size());
        for (size_t i = 0; i < keys.size(); ++i) found[i] = in.number<uint8_t>() != 0;
        return found;
    });
}

std::vector<std::string> PageClient::put(uint8_t* pool, uint64_t pool_bytes, double ttl_s,
                                         const std::vector<PagePut>& pages) {
    // Refuse what the wire cannot carry before any region is taken (the worker checks the rest).
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
    std::vector<std::string> hashes;
    hashes.reserve(pages.size());
    // Batches of at most a quarter of the pool: a connection may hold half of it uncommitted.
    const uint64_t batch_bytes = pool_bytes / 4;
    size_t start = 0;
    uint64_t size = 0;
    const auto flush = [&](size_t end) {
        auto batch = put_batch(pool, pool_bytes, ttl_s, pages.data() + start, end - start);
        hashes.insert(hashes.end(), batch.begin(), batch.end());
        start = end;
        size = 0;
    };
    for (size_t i = 0; i < pages.size(); ++i) {
        if (i > start &&
            (size + pages[i].size_bytes > batch_bytes || i - start == kMaxPageBatch))
            flush(i);
        size += pages[i].size_bytes;
    }
    flush(pages.size());
    return hashes;
}

std::vector<std::string> PageClient::put_batch(uint8_t* pool, uint64_t pool_bytes, double ttl_s,
                                               const PagePut* pages, size_t count) {
    if (count == 0) return {};
    constexpr uint64_t kNone = ~0ull;
    std::vector<uint64_t> sizes(count), offsets(count, kNone);
    uint64_t spare_bytes = 0, batch_bytes = 0;
    for (size_t i = 0; i < count; ++i) batch_bytes += sizes[i] = pages[i].size_bytes;
    {
        std::lock_guard<std::mutex> lock(spare_mutex_);
        for (size_t i = 0; i < count; ++i) {
            auto it = spare_.find(sizes[i]);
            if (it == spare_.end() || it->second.empty()) continue;
            offsets[i] = it->second.back();
            it->second.pop_back();
        }
        for (const auto& [n, regions] : spare_) spare_bytes += n * regions.size();
    }
    std::vector<uint64_t> wanted;
    for (size_t i = 0; i < count; ++i)
        if (offsets[i] == kNone) wanted.push_back(sizes[i]);
    if (!wanted.empty()) {
        std::vector<uint64_t> got;
        try {
            got = alloc(wanted);
        } catch (...) {  // the reserved regions taken are still ours: keep them
            std::lock_guard<std::mutex> lock(spare_mutex_);
            for (size_t i = 0; i < count; ++i)
                if (offsets[i] != kNone) spare_[sizes[i]].push_back(offsets[i]);
            throw;
        }
        size_t next = 0;
        for (auto& offset : offsets)
            if (offset == kNone) offset = got[next++];
    }
    if (batch_bytes <= kWakeMaxBytes) wake();
    std::vector<CopyJob> jobs(count);
    for (size_t i = 0; i < count; ++i) {
        if (offsets[i] > pool_bytes || sizes[i] > pool_bytes - offsets[i]) {
            broken_ = true;  // the worker's pool is not the one mapped here
            throw StatusError("Unavailable", "the worker gave a page region outside the pool "
                                             "mapped here; reconnect");
        }
        jobs[i] = CopyJob{pool + offsets[i], pages[i].data, sizes[i]};
    }
    const std::vector<Digest> digests = parallel_copy_hash_many(jobs, 0);
    std::vector<PageWrite> writes(count);
    std::vector<std::string> hashes(count);
    for (size_t i = 0; i < count; ++i) {
        PageWrite& w = writes[i];
        static_cast<PageMeta&>(w) = pages[i];
        w.offset = offsets[i];
        w.size_bytes = sizes[i];
        w.hash = hashes[i] = hex(digests[i]);
    }
    // Reserve as much again for the next put, within the per-connection bound.
    const bool reserve = spare_bytes + batch_bytes <= std::min(kMaxSpareBytes, pool_bytes / 4);
    const std::vector<uint64_t> ahead = reserve ? sizes : std::vector<uint64_t>{};
    const std::vector<uint64_t> reserved = commit(ttl_s, writes, ahead);
    std::lock_guard<std::mutex> lock(spare_mutex_);
    for (size_t i = 0; i < reserved.size(); ++i) spare_[ahead[i]].push_back(reserved[i]);
    return hashes;
}

void PageClient::wake() {
    std::lock_guard<std::mutex> lock(call_mutex_);
    if (broken_ || fd_ < 0 || net::Clock::now() - last_reply_ < kWakeAfter) return;
    const uint8_t header[page_wire::kHeaderBytes] = {kPageProtocolVersion, page_wire::kWake};
    // Best effort: a full socket buffer or a failure is the next request's to report.
    [[maybe_unused]] const ssize_t n =
        ::send(fd_, header, sizeof header, MSG_DONTWAIT | MSG_NOSIGNAL);
}

bool PageClient::hung_up() {
    std::lock_guard<std::mutex> lock(call_mutex_);
    if (broken_ || fd_ < 0) return true;
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, 0) > 0) broken_ = true;  // the worker never writes unasked
    return broken_;
}

std::map<uint64_t, std::vector<uint64_t>> PageClient::spare() const {
    std::lock_guard<std::mutex> lock(spare_mutex_);
    return spare_;
}

uint64_t PageClient::requests_sent(uint8_t op) const { return sent_[op % sent_.size()]; }

}  // namespace tc
