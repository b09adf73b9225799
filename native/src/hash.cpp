#include "tensorcast/hash.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "parallel.h"

#include "xxh.h"

namespace tc {
namespace {

struct ChunkTask {
    const uint8_t* data;
    size_t size_bytes;
    uint8_t* digest_out;  // 16 bytes inside the owning buffer's record
};

}  // namespace

std::vector<Digest> tree_hash_many(
    const std::vector<std::pair<const uint8_t*, size_t>>& buffers, unsigned threads) {
    // One flat allocation of per-buffer records: the chunk digests followed by
    // the 8-byte length trailer, i.e. exactly the input of the final hash.
    std::vector<size_t> record_offsets(buffers.size() + 1, 0);
    size_t total_chunks = 0;
    size_t total_bytes = 0;
    for (size_t b = 0; b < buffers.size(); ++b) {
        const size_t chunks = (buffers[b].second + kTreeHashChunkBytes - 1) / kTreeHashChunkBytes;
        record_offsets[b + 1] = record_offsets[b] + chunks * 16 + 8;
        total_chunks += chunks;
        total_bytes += buffers[b].second;
    }
    std::vector<uint8_t> records(record_offsets.back());
    std::vector<ChunkTask> tasks;
    tasks.reserve(total_chunks);
    for (size_t b = 0; b < buffers.size(); ++b) {
        const auto [data, size_bytes] = buffers[b];
        uint8_t* record = records.data() + record_offsets[b];
        size_t offset = 0;
        for (; offset < size_bytes; offset += kTreeHashChunkBytes, record += 16)
            tasks.push_back({data + offset, std::min(kTreeHashChunkBytes, size_bytes - offset), record});
    }

    // One worker per full chunk of input at most: under 2 chunks stays on this thread.
    const size_t byte_bound = std::max<size_t>(1, total_bytes / kTreeHashChunkBytes);
    const unsigned workers = unsigned(std::max<size_t>(
        1, std::min({size_t(detail::resolve_threads(threads)), tasks.size(), byte_bound})));
    // Dynamic claiming keeps threads busy when buffer sizes are very uneven.
    std::atomic<size_t> next{0};
    detail::run_workers(workers, [&](unsigned) {
        for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < tasks.size();) {
            const ChunkTask& task = tasks[i];
            xxh::store_canonical(xxh::hash128(task.data, task.size_bytes), task.digest_out);
        }
    });

    std::vector<Digest> digests(buffers.size());
    for (size_t b = 0; b < buffers.size(); ++b) {
        const size_t chunks = (record_offsets[b + 1] - record_offsets[b] - 8) / 16;
        digests[b] = tree_hash_finish(records.data() + record_offsets[b], chunks, buffers[b].second);
    }
    return digests;
}

Digest tree_hash_finish(uint8_t* record, size_t chunks, uint64_t size_bytes) {
    uint8_t* trailer = record + 16 * chunks;
    for (int i = 0; i < 8; ++i) trailer[i] = uint8_t(size_bytes >> (8 * i));
    Digest digest;
    xxh::store_canonical(XXH3_128bits(record, 16 * chunks + 8), digest.data());
    return digest;
}

Digest tree_hash(const uint8_t* data, size_t size_bytes, unsigned threads) {
    return tree_hash_many({{data, size_bytes}}, threads)[0];
}

}  // namespace tc
