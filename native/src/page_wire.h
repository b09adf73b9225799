// Internal: the page socket's frame codec (the format is in page_server.h), shared by the
// server (page_server.cpp) and the caller's end (page_client.cpp).
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "tensorcast/errors.h"
#include "tensorcast/page_index.h"

namespace tc::page_wire {

// 1-6: the same-host page socket; READ and PUT carry page bytes after the body, for callers on
// other hosts (the worker's data port, page_remote.h). HELLO and EXISTS serve both.
enum Op : uint8_t {
    kHello = 1,
    kAlloc = 2,
    kCommit = 3,
    kGet = 4,
    kExists = 5,
    kWake = 6,
    kRead = 7,
    kPut = 8
};
constexpr size_t kHeaderBytes = 8;
constexpr size_t kMinKeyBytes = 14;    // str (2) + shard (4) + token (8)
constexpr size_t kMinWriteBytes = 40;  // the fixed part of a commit's page
constexpr size_t kMinPutBytes = 33;    // the fixed part of a remote put's page

inline StatusError malformed(const std::string& what) {
    return StatusError("InvalidArgument", "malformed page request: " + what);
}

// Bounds-checked little-endian reads from a message body.
class Reader {
public:
    Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}

    template <typename T>
    T number() {
        need(sizeof(T));
        T value;
        std::memcpy(&value, data_ + at_, sizeof(T));
        at_ += sizeof(T);
        return value;
    }
    std::string str() { return bytes(number<uint16_t>()); }
    std::string bytes(size_t n) {
        need(n);
        std::string out(reinterpret_cast<const char*>(data_ + at_), n);
        at_ += n;
        return out;
    }
    std::vector<int64_t> shape() {
        const uint8_t ndim = number<uint8_t>();
        std::vector<int64_t> out(ndim);
        for (auto& d : out) d = number<int64_t>();
        return out;
    }
    uint32_t count(size_t limit, size_t min_item_bytes) {
        const uint32_t n = number<uint32_t>();
        if (n > limit)
            throw StatusError("InvalidArgument", "batch of " + std::to_string(n) +
                                                     " items, the limit is " +
                                                     std::to_string(limit));
        need(size_t(n) * min_item_bytes);  // cheap guard before reserving anything
        return n;
    }
    void end() const {
        if (at_ != size_) throw malformed(std::to_string(size_ - at_) + " trailing bytes");
    }

private:
    void need(size_t n) const {
        if (n > size_ - at_) throw malformed("body ends early");
    }
    const uint8_t* data_;
    size_t size_;
    size_t at_ = 0;
};

class Writer {
public:
    template <typename T>
    void number(T value) {
        const size_t at = out.size();
        out.resize(at + sizeof(T));
        std::memcpy(out.data() + at, &value, sizeof(T));
    }
    // Strings longer than the format allows are refused, not cut: a cut key names another page.
    void str(const std::string& s) {
        if (s.size() > 0xffff)
            throw StatusError("InvalidArgument",
                              "string of " + std::to_string(s.size()) + " bytes in a page request");
        number(uint16_t(s.size()));
        out.insert(out.end(), s.begin(), s.end());
    }
    void shape(const std::vector<int64_t>& dims) {
        if (dims.size() > 255)
            throw StatusError("InvalidArgument",
                              "page shape of " + std::to_string(dims.size()) + " dimensions");
        number(uint8_t(dims.size()));
        for (int64_t d : dims) number(d);
    }
    std::vector<uint8_t> out;
};

inline void write_keys(Writer& out, const std::vector<PageKey>& keys) {
    out.number(uint32_t(keys.size()));
    for (const auto& k : keys) {
        out.str(k.key);
        out.number(k.shard);
        out.number(k.token);
    }
}

inline std::vector<PageKey> read_keys(Reader& in) {
    std::vector<PageKey> keys(in.count(kMaxPageBatch, kMinKeyBytes));
    for (auto& k : keys) {
        k.key = in.str();
        k.shard = in.number<uint32_t>();
        k.token = in.number<uint64_t>();
    }
    in.end();
    return keys;
}

inline void write_page(Writer& out, const PageWrite& w) {
    out.str(w.key);
    out.number(w.shard);
    out.number(w.token);
    out.str(w.dtype);
    out.shape(w.shape);
    out.number(w.offset);
    out.number(w.size_bytes);
    out.str(w.hash);
}

inline PageWrite read_page(Reader& in) {
    PageWrite w;
    w.key = in.str();
    w.shard = in.number<uint32_t>();
    w.token = in.number<uint64_t>();
    w.dtype = in.str();
    w.shape = in.shape();
    w.offset = in.number<uint64_t>();
    w.size_bytes = in.number<uint64_t>();
    w.hash = in.str();
    return w;
}

// A page a remote PUT carries (its bytes follow the body, in order): what it is and its hash.
inline void write_put(Writer& out, const PageMeta& meta, uint64_t size_bytes,
                      const std::string& hash) {
    out.str(meta.key);
    out.number(meta.shard);
    out.number(meta.token);
    out.str(meta.dtype);
    out.shape(meta.shape);
    out.number(size_bytes);
    out.str(hash);
}

inline PageWrite read_put(Reader& in) {
    PageWrite w;
    w.key = in.str();
    w.shard = in.number<uint32_t>();
    w.token = in.number<uint64_t>();
    w.dtype = in.str();
    w.shape = in.shape();
    w.size_bytes = in.number<uint64_t>();
    w.hash = in.str();
    return w;
}

// One entry of a READ reply: found, then (size, dtype, shape, hash); the bytes follow the body.
inline void write_found(Writer& out, const std::optional<Page>& page) {
    out.number(uint8_t(page.has_value()));
    if (!page) return;
    out.number(page->size_bytes);
    out.str(page->dtype);
    out.shape(page->shape);
    out.str(page->hash);
}

inline std::optional<PageWrite> read_found(Reader& in) {
    const uint8_t found = in.number<uint8_t>();
    if (found > 1) throw malformed("found flag " + std::to_string(found));
    if (!found) return std::nullopt;
    PageWrite w;
    w.size_bytes = in.number<uint64_t>();
    w.dtype = in.str();
    w.shape = in.shape();
    w.hash = in.str();
    if (w.size_bytes > kMaxPageBytes) throw malformed("page of " + std::to_string(w.size_bytes) + " bytes");
    return w;
}

// A remote PUT's body (page_remote.h), parsed and checked: at most kMaxPageBatch pages of at most
// kMaxPageBytes each, known flags, and at most `max_total_bytes` of page bytes to follow. Pure:
// throws StatusError("InvalidArgument") on anything else (the fuzz target calls it directly).
constexpr uint8_t kPutIfAbsent = 1;
constexpr uint8_t kPutExpiresIn = 2;  // an f64 first lease follows the flags

struct PutRequest {
    double ttl_s = 0;
    bool if_absent = false;
    double expires_in_s = 0;  // 0: ttl_s
    std::vector<PageWrite> pages;  // offsets 0
    uint64_t total_bytes = 0;
};

inline PutRequest parse_put(const uint8_t* body, size_t size, uint64_t max_total_bytes) {
    Reader in(body, size);
    PutRequest out;
    out.ttl_s = in.number<double>();
    const uint8_t flags = in.number<uint8_t>();
    if (flags > (kPutIfAbsent | kPutExpiresIn))
        throw malformed("unknown put flags " + std::to_string(flags));
    out.if_absent = flags & kPutIfAbsent;
    if (flags & kPutExpiresIn) {
        out.expires_in_s = in.number<double>();
        if (!(out.expires_in_s > 0)) throw malformed("a first lease that is not > 0");
    }
    out.pages.resize(in.count(kMaxPageBatch, kMinPutBytes));
    for (auto& w : out.pages) {
        w = read_put(in);
        if (w.size_bytes > kMaxPageBytes)
            throw StatusError("InvalidArgument", "page of " + std::to_string(w.size_bytes) +
                                                     " bytes, the limit is " +
                                                     std::to_string(kMaxPageBytes));
        out.total_bytes += w.size_bytes;
    }
    in.end();
    if (out.total_bytes > max_total_bytes)
        throw StatusError("InvalidArgument", "a put of " + std::to_string(out.total_bytes) +
                                                 " page bytes, the limit per request is " +
                                                 std::to_string(max_total_bytes));
    return out;
}

inline void write_offsets(Writer& out, const std::vector<uint64_t>& values) {
    out.number(uint32_t(values.size()));
    for (uint64_t v : values) out.number(v);
}

inline std::vector<uint64_t> read_offsets(Reader& in) {
    std::vector<uint64_t> out(in.count(kMaxPageBatch, 8));
    for (auto& v : out) v = in.number<uint64_t>();
    return out;
}

}  // namespace tc::page_wire
