// libFuzzer target for the page protocol's body parsers (page_wire.h), the ones the worker runs
// on bytes from callers on other hosts (page_remote.cpp) and on its own socket: the first input
// byte picks the parser, the rest is a body. Invariants: never crash, never read past the body,
// refuse only with StatusError; an accepted PUT stays within its limits and re-encodes to the
// same bytes.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "../src/page_wire.h"

namespace w = tc::page_wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size == 0) return 0;
    const uint8_t which = data[0] % 4;
    const uint8_t* body = data + 1;
    const size_t n = size - 1;
    try {
        switch (which) {
            case 0: {
                w::Reader in(body, n);
                const auto keys = w::read_keys(in);
                if (keys.size() > tc::kMaxPageBatch) std::abort();
                break;
            }
            case 1: {
                const auto put = w::parse_put(body, n, 1ull << 30);
                uint64_t total = 0;
                w::Writer again;
                again.number(put.ttl_s);
                again.number(uint8_t((put.if_absent ? w::kPutIfAbsent : 0) |
                                     (put.expires_in_s > 0 ? w::kPutExpiresIn : 0)));
                if (put.expires_in_s > 0) again.number(put.expires_in_s);
                again.number(uint32_t(put.pages.size()));
                for (const auto& p : put.pages) {
                    if (p.size_bytes > tc::kMaxPageBytes) std::abort();
                    total += p.size_bytes;
                    w::write_put(again, p, p.size_bytes, p.hash);
                }
                if (total != put.total_bytes || total > (1ull << 30)) std::abort();
                if (again.out.size() != n || std::memcmp(again.out.data(), body, n) != 0)
                    std::abort();
                break;
            }
            case 2: {
                w::Reader in(body, n);
                const uint32_t count = in.number<uint32_t>();
                for (uint32_t i = 0; i < count && i < tc::kMaxPageBatch; ++i) {
                    const auto found = w::read_found(in);
                    if (found && found->size_bytes > tc::kMaxPageBytes) std::abort();
                }
                break;
            }
            default: {
                w::Reader in(body, n);
                const auto offsets = w::read_offsets(in);
                if (offsets.size() > tc::kMaxPageBatch) std::abort();
                break;
            }
        }
    } catch (const tc::StatusError&) {
    }
    return 0;
}
