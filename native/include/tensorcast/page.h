// A KV page as the index and its shared-memory directory describe it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tc {

double monotonic_s();  // CLOCK_MONOTONIC, the clock of Python's time.monotonic()

// What a page is: its key, the shard and lease token it is written under, dtype and shape.
struct PageMeta {
    std::string key;
    uint32_t shard = 0;
    uint64_t token = 0;
    std::string dtype;
    std::vector<int64_t> shape;
};

struct PageWrite : PageMeta {
    uint64_t offset = 0;  // where its bytes were written in the pool
    uint64_t size_bytes = 0;
    std::string hash;  // hex tree hash the writer claims
};

struct Page : PageWrite {
    double expires_at = 0;  // monotonic seconds
    double ttl_s = 0;       // the lease it was put with: a read renews it for as long again
    bool home = false;
};

}  // namespace tc
