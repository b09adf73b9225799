// Data-plane wire format v1: every frame is a fixed 48-byte little-endian header,
// followed by payload_bytes of payload. Pure functions, no I/O, so the parser
// can be unit-tested and fuzzed on its own.
//
//   off size field
//     0  4   magic          "TCDP" (bytes 54 43 44 50)
//     4  2   version        1
//     6  2   type           FrameType
//     8  4   payload_bytes  per-type limit, see below
//    12  4   reserved       0
//    16  8   request_id     echoed by the server in DATA / ERROR
//    24  8   a              per type
//    32  8   b              per type
//    40  8   c              per type
//
//   HELLO    c->s  payload = token (<= 1 KiB); a, b, c = 0
//   HELLO_OK s->c  no payload; a = largest READ length the server accepts; b, c = 0
//   READ     c->s  no payload; a = ticket, b = pool offset, c = length (1..kMaxDataBytes)
//   DATA     s->c  payload = the bytes; a = pool offset, b = length (= payload_bytes),
//                  c = XXH3-64 (seed 0) of the payload
//   ERROR    s->c  payload = message (<= 1 KiB); a = ErrorCode (!= 0); b, c = 0
//
// Exactly the headers encode_header can produce are accepted: unused fields must
// be zero, so any bit flip in a valid header is either rejected or meaningful.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tc::frame {

constexpr uint32_t kMagic = 0x50444354;  // "TCDP" read as little-endian u32
constexpr uint16_t kVersion = 1;
constexpr size_t kHeaderBytes = 48;
constexpr uint32_t kMaxTokenBytes = 1024;
constexpr uint32_t kMaxErrorMessageBytes = 1024;
constexpr uint64_t kMaxDataBytes = 64ull << 20;  // per READ / DATA frame

enum class Type : uint16_t { kHello = 1, kHelloOk = 2, kRead = 3, kData = 4, kError = 5 };

enum class ErrorCode : uint64_t {
    kProtocol = 1,          // malformed or unexpected frame; connection closed
    kBadToken = 2,          // connection closed
    kNotAuthenticated = 3,  // READ before HELLO_OK; connection closed
    kBadTicket = 4,         // unknown or expired ticket; connection stays open
    kOutOfRange = 5,        // READ outside its ticket's range; connection stays open
    kBusy = 6,              // too many connections; connection closed
};
constexpr uint64_t kMaxErrorCode = 0xffff;  // codes above are rejected as malformed

struct Header {
    Type type = Type::kHello;
    uint32_t payload_bytes = 0;
    uint64_t request_id = 0;
    uint64_t a = 0;
    uint64_t b = 0;
    uint64_t c = 0;
};

enum class Status {
    kOk,
    kTruncated,  // fewer than kHeaderBytes given
    kBadMagic,
    kBadVersion,
    kBadType,
    kBadLength,  // payload_bytes over the type's limit or inconsistent with it
    kBadField,   // reserved / unused field not zero, zero length, overflow, ...
};

const char* status_name(Status status);

// Validates and decodes one header from the first kHeaderBytes of `bytes`.
// `out` is written only on kOk.
Status decode_header(const uint8_t* bytes, size_t size_bytes, Header* out);

// Writes kHeaderBytes. Does not validate: callers build headers with the helpers below.
void encode_header(const Header& header, uint8_t* out);

inline Header hello(uint32_t token_bytes) {
    Header h;
    h.type = Type::kHello;
    h.payload_bytes = token_bytes;
    return h;
}
inline Header hello_ok() {
    Header h;
    h.type = Type::kHelloOk;
    h.a = kMaxDataBytes;
    return h;
}
inline Header read(uint64_t request_id, uint64_t ticket, uint64_t offset, uint64_t length_bytes) {
    return Header{Type::kRead, 0, request_id, ticket, offset, length_bytes};
}
inline Header data(uint64_t request_id, uint64_t offset, uint64_t length_bytes, uint64_t checksum) {
    return Header{Type::kData, uint32_t(length_bytes), request_id, offset, length_bytes, checksum};
}
inline Header error(uint64_t request_id, ErrorCode code, uint32_t message_bytes) {
    return Header{Type::kError, message_bytes, request_id, uint64_t(code), 0, 0};
}

}  // namespace tc::frame
