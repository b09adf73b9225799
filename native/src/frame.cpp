#include "tensorcast/frame.h"

namespace tc::frame {
namespace {

// Byte-wise so the format is little-endian on any host and alignment-free.
uint64_t load_le(const uint8_t* p, int size) {
    uint64_t value = 0;
    for (int i = size - 1; i >= 0; --i) value = (value << 8) | p[i];
    return value;
}

void store_le(uint8_t* p, uint64_t value, int size) {
    for (int i = 0; i < size; ++i) p[i] = uint8_t(value >> (8 * i));
}

bool sum_overflows(uint64_t x, uint64_t y) { return x + y < x; }

}  // namespace

const char* status_name(Status status) {
    switch (status) {
        case Status::kOk: return "ok";
        case Status::kTruncated: return "truncated header";
        case Status::kBadMagic: return "bad magic";
        case Status::kBadVersion: return "unsupported version";
        case Status::kBadType: return "unknown frame type";
        case Status::kBadLength: return "bad payload length";
        case Status::kBadField: return "bad header field";
    }
    return "unknown status";
}

Status decode_header(const uint8_t* bytes, size_t size_bytes, Header* out) {
    if (bytes == nullptr || size_bytes < kHeaderBytes) return Status::kTruncated;
    if (load_le(bytes, 4) != kMagic) return Status::kBadMagic;
    if (load_le(bytes + 4, 2) != kVersion) return Status::kBadVersion;
    const uint64_t raw_type = load_le(bytes + 6, 2);
    if (raw_type < uint64_t(Type::kHello) || raw_type > uint64_t(Type::kError))
        return Status::kBadType;
    Header h;
    h.type = Type(raw_type);
    h.payload_bytes = uint32_t(load_le(bytes + 8, 4));
    const uint64_t reserved = load_le(bytes + 12, 4);
    h.request_id = load_le(bytes + 16, 8);
    h.a = load_le(bytes + 24, 8);
    h.b = load_le(bytes + 32, 8);
    h.c = load_le(bytes + 40, 8);
    if (reserved != 0) return Status::kBadField;

    switch (h.type) {
        case Type::kHello:
            if (h.payload_bytes > kMaxTokenBytes) return Status::kBadLength;
            if (h.a != 0 || h.b != 0 || h.c != 0) return Status::kBadField;
            break;
        case Type::kHelloOk:
            if (h.payload_bytes != 0) return Status::kBadLength;
            if (h.a == 0 || h.a > kMaxDataBytes || h.b != 0 || h.c != 0) return Status::kBadField;
            break;
        case Type::kRead:
            if (h.payload_bytes != 0) return Status::kBadLength;
            if (h.c == 0 || h.c > kMaxDataBytes || sum_overflows(h.b, h.c))
                return Status::kBadField;
            break;
        case Type::kData:
            if (h.b == 0 || h.b > kMaxDataBytes || h.payload_bytes != h.b)
                return Status::kBadLength;
            if (sum_overflows(h.a, h.b)) return Status::kBadField;
            break;
        case Type::kError:
            if (h.payload_bytes > kMaxErrorMessageBytes) return Status::kBadLength;
            if (h.a == 0 || h.a > kMaxErrorCode || h.b != 0 || h.c != 0) return Status::kBadField;
            break;
    }
    *out = h;
    return Status::kOk;
}

void encode_header(const Header& h, uint8_t* out) {
    store_le(out, kMagic, 4);
    store_le(out + 4, kVersion, 2);
    store_le(out + 6, uint16_t(h.type), 2);
    store_le(out + 8, h.payload_bytes, 4);
    store_le(out + 12, 0, 4);
    store_le(out + 16, h.request_id, 8);
    store_le(out + 24, h.a, 8);
    store_le(out + 32, h.b, 8);
    store_le(out + 40, h.c, 8);
}

}  // namespace tc::frame
