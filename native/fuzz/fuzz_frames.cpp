// libFuzzer target for the frame parser: treats the input as a byte stream of
// frames (header, then payload_bytes of payload), as a connection would.
// Invariants: never crash; every accepted header is canonical (re-encodes to
// the same bytes) and within the per-type limits.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "tensorcast/frame.h"

namespace f = tc::frame;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    size_t offset = 0;
    while (offset < size) {
        f::Header h;
        const f::Status status = f::decode_header(data + offset, size - offset, &h);
        if (status != f::Status::kOk) break;  // a connection would be closed here
        uint8_t again[f::kHeaderBytes];
        f::encode_header(h, again);
        if (std::memcmp(again, data + offset, f::kHeaderBytes) != 0) std::abort();
        switch (h.type) {
            case f::Type::kHello:
                if (h.payload_bytes > f::kMaxTokenBytes) std::abort();
                break;
            case f::Type::kError:
                if (h.payload_bytes > f::kMaxErrorMessageBytes || h.a == 0) std::abort();
                break;
            case f::Type::kData:
                if (h.payload_bytes != h.b || h.b > f::kMaxDataBytes || h.a + h.b < h.a)
                    std::abort();
                break;
            case f::Type::kRead:
                if (h.payload_bytes != 0 || h.c == 0 || h.c > f::kMaxDataBytes) std::abort();
                break;
            case f::Type::kHelloOk:
                if (h.payload_bytes != 0) std::abort();
                break;
        }
        offset += f::kHeaderBytes;
        if (h.payload_bytes > size - offset) break;  // truncated payload: wait for more
        offset += h.payload_bytes;
    }
    return 0;
}
