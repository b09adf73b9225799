// Internal: the page socket's frame codec (the format is in page_server.h), shared by the
// server (page_server.cpp) and the caller's end (page_client.cpp).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "tensorcast/errors.h"
#include "tensorcast/page_index.h"

namespace tc::page_wire {

enum Op : uint8_t { kHello = 1, kAlloc = 2, kCommit = 3, kGet = 4, kExists = 5, kWake = 6 };
constexpr size_t kHeaderBytes = 8;
constexpr size_t kMinKeyBytes = 14;    // str (2) + shard (4) + token (8)
constexpr size_t kMinWriteBytes = 40;  // the fixed part of a commit's page

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
