// Frame header codec: round trips, rejection of malformed headers, and a
// deterministic 100k-case random/mutation loop checked against an independent
// reading of the spec in frame.h.
#include "check.h"
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "tensorcast/frame.h"

namespace {

namespace f = tc::frame;


using Raw = std::vector<uint8_t>;

Raw encode(const f::Header& h) {
    Raw raw(f::kHeaderBytes);
    f::encode_header(h, raw.data());
    return raw;
}

f::Status decode(const Raw& raw, f::Header* out = nullptr) {
    f::Header scratch;
    return f::decode_header(raw.data(), raw.size(), out != nullptr ? out : &scratch);
}

bool same(const f::Header& x, const f::Header& y) {
    return x.type == y.type && x.payload_bytes == y.payload_bytes &&
           x.request_id == y.request_id && x.a == y.a && x.b == y.b && x.c == y.c;
}

uint64_t get(const Raw& raw, size_t offset, int size) {
    uint64_t v = 0;
    for (int i = size - 1; i >= 0; --i) v = (v << 8) | raw[offset + size_t(i)];
    return v;
}

void put(Raw& raw, size_t offset, uint64_t value, int size) {
    for (int i = 0; i < size; ++i) raw[offset + size_t(i)] = uint8_t(value >> (8 * i));
}

// Second, independent statement of the validity rules (kept deliberately
// literal): a divergence from decode_header is a bug in one of them.
bool reference_valid(const Raw& raw) {
    if (raw.size() < 48) return false;
    if (raw[0] != 'T' || raw[1] != 'C' || raw[2] != 'D' || raw[3] != 'P') return false;
    if (get(raw, 4, 2) != 1 || get(raw, 12, 4) != 0) return false;
    const uint64_t type = get(raw, 6, 2), len = get(raw, 8, 4);
    const uint64_t a = get(raw, 24, 8), b = get(raw, 32, 8), c = get(raw, 40, 8);
    const uint64_t max_data = 64ull << 20;
    switch (type) {
        case 1: return len <= 1024 && a == 0 && b == 0 && c == 0;
        case 2: return len == 0 && a >= 1 && a <= max_data && b == 0 && c == 0;
        case 3: return len == 0 && c >= 1 && c <= max_data && b <= UINT64_MAX - c;
        case 4: return b >= 1 && b <= max_data && len == b && a <= UINT64_MAX - b;
        case 5: return len <= 1024 && a >= 1 && a <= 0xffff && b == 0 && c == 0;
        default: return false;
    }
}

void test_round_trips() {
    const f::Header headers[] = {
        f::hello(0), f::hello(7), f::hello(1024), f::hello_ok(),
        f::read(1, 0xdeadbeefcafef00d, 0, 1), f::read(~0ull, 5, 123456789, 64ull << 20),
        f::data(9, 4096, 4 << 20, 0x0123456789abcdef), f::data(0, ~0ull - 1, 1, ~0ull),
        f::error(3, f::ErrorCode::kBadTicket, 0), f::error(4, f::ErrorCode::kBusy, 1024),
    };
    for (const f::Header& h : headers) {
        const Raw raw = encode(h);
        f::Header back;
        CHECK(decode(raw, &back) == f::Status::kOk);
        CHECK(same(h, back));
        CHECK(reference_valid(raw));
        CHECK(encode(back) == raw);
    }
    // Pin the byte layout.
    const Raw raw = encode(f::read(0x0102, 0x0a0b, 0x10, 0x20));
    CHECK(std::memcmp(raw.data(), "TCDP\x01\x00\x03\x00", 8) == 0);
    CHECK(get(raw, 16, 8) == 0x0102 && get(raw, 24, 8) == 0x0a0b);
    CHECK(get(raw, 32, 8) == 0x10 && get(raw, 40, 8) == 0x20);
}

void test_rejections() {
    const Raw good = encode(f::data(1, 100, 4096, 42));
    CHECK(decode(good) == f::Status::kOk);
    for (size_t n = 0; n < f::kHeaderBytes; ++n) {
        f::Header h;
        CHECK(f::decode_header(good.data(), n, &h) == f::Status::kTruncated);
    }
    { f::Header h; CHECK(f::decode_header(nullptr, 48, &h) == f::Status::kTruncated); }
    Raw r = good; r[0] = 'X';                 CHECK(decode(r) == f::Status::kBadMagic);
    r = good; put(r, 4, 2, 2);                CHECK(decode(r) == f::Status::kBadVersion);
    r = good; put(r, 4, 0, 2);                CHECK(decode(r) == f::Status::kBadVersion);
    for (uint64_t type : {0ull, 6ull, 0x100ull, 0xffffull}) {
        r = good; put(r, 6, type, 2);         CHECK(decode(r) == f::Status::kBadType);
    }
    r = good; put(r, 12, 1, 4);               CHECK(decode(r) == f::Status::kBadField);
    // DATA: payload must equal the length field, within 64 MiB.
    r = good; put(r, 8, 4097, 4);             CHECK(decode(r) == f::Status::kBadLength);
    r = encode(f::data(1, 0, (64ull << 20) + 1, 0)); CHECK(decode(r) == f::Status::kBadLength);
    r = encode(f::data(1, 0, 0, 0));          CHECK(decode(r) == f::Status::kBadLength);
    r = encode(f::data(1, ~0ull, 2, 0));      CHECK(decode(r) == f::Status::kBadField);
    // HELLO / ERROR payload limits and unused fields.
    r = encode(f::hello(1025));               CHECK(decode(r) == f::Status::kBadLength);
    r = encode(f::hello(0xffffffffu));        CHECK(decode(r) == f::Status::kBadLength);
    r = encode(f::hello(5)); put(r, 32, 1, 8); CHECK(decode(r) == f::Status::kBadField);
    r = encode(f::error(1, f::ErrorCode::kProtocol, 1025));
    CHECK(decode(r) == f::Status::kBadLength);
    r = encode(f::error(1, f::ErrorCode(0), 3)); CHECK(decode(r) == f::Status::kBadField);
    // READ: no payload, 1..64 MiB, no overflow.
    r = encode(f::read(1, 2, 3, 4)); put(r, 8, 1, 4); CHECK(decode(r) == f::Status::kBadLength);
    r = encode(f::read(1, 2, 3, 0));          CHECK(decode(r) == f::Status::kBadField);
    r = encode(f::read(1, 2, 3, (64ull << 20) + 1)); CHECK(decode(r) == f::Status::kBadField);
    r = encode(f::read(1, 2, ~0ull, 1));      CHECK(decode(r) == f::Status::kBadField);
    r = encode(f::hello_ok()); put(r, 8, 4, 4); CHECK(decode(r) == f::Status::kBadLength);
}

uint64_t interesting(std::mt19937_64& rng) {
    static const uint64_t values[] = {0, 1, 2, 255, 1024, 1025, 4096, 64ull << 20,
                                      (64ull << 20) + 1, 0xffff, 0x10000, 0xffffffffull,
                                      ~0ull, ~0ull - 1, 1ull << 63};
    return rng() % 3 == 0 ? rng() : values[rng() % (sizeof values / sizeof values[0])];
}

void test_random_headers() {
    std::mt19937_64 rng(20240611);
    int accepted = 0;
    for (int i = 0; i < 100000; ++i) {
        Raw raw(f::kHeaderBytes);
        switch (i % 3) {
            case 0:  // fully random bytes
                for (auto& byte : raw) byte = uint8_t(rng());
                break;
            case 1: {  // a valid header with a few bit flips / byte stores
                const f::Header seeds[] = {f::hello(uint32_t(rng() % 1025)), f::hello_ok(),
                                           f::read(rng(), rng(), rng() >> 2, 1 + rng() % 4096),
                                           f::data(rng(), rng() >> 2, 1 + rng() % (64 << 20),
                                                   rng()),
                                           f::error(rng(), f::ErrorCode(1 + rng() % 6),
                                                    uint32_t(rng() % 1025))};
                raw = encode(seeds[rng() % 5]);
                for (int m = int(rng() % 4); m > 0; --m) {
                    if (rng() % 2) raw[rng() % raw.size()] ^= uint8_t(1u << (rng() % 8));
                    else raw[rng() % raw.size()] = uint8_t(rng());
                }
                break;
            }
            default:  // right magic/version, random type and edge-case fields
                put(raw, 0, f::kMagic, 4);
                put(raw, 4, rng() % 8 ? 1 : rng() % 3, 2);
                put(raw, 6, rng() % 8, 2);
                put(raw, 8, interesting(rng), 4);
                put(raw, 12, rng() % 16 ? 0 : interesting(rng), 4);
                for (size_t offset : {16u, 24u, 32u, 40u}) put(raw, offset, interesting(rng), 8);
                break;
        }
        f::Header h;
        const bool ok = f::decode_header(raw.data(), raw.size(), &h) == f::Status::kOk;
        if (ok != reference_valid(raw)) {
            std::fprintf(stderr, "case %d: decode %s, reference %s\n", i,
                         ok ? "accepts" : "rejects", reference_valid(raw) ? "accepts" : "rejects");
            ++failures;
            if (failures > 10) return;
        }
        if (ok) {
            ++accepted;
            CHECK(encode(h) == raw);  // accepted headers are canonical
        }
    }
    std::printf("random headers: 100000 cases, %d accepted\n", accepted);
    CHECK(accepted > 10000);  // the generator does reach the valid space
}

}  // namespace

int main() {
    test_round_trips();
    test_rejections();
    test_random_headers();
    if (failures != 0) {
        std::fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    std::puts("all frame checks passed");
    return 0;
}
