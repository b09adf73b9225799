#include "tensorcast/hash.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "parallel.h"

#include "xxh.h"

namespace tc {

std::string hex(const Digest& digest) {
    static const char* digits = "0123456789abcdef";
    std::string out(2 * digest.size(), '0');
    for (size_t i = 0; i < digest.size(); ++i) {
        out[2 * i] = digits[digest[i] >> 4];
        out[2 * i + 1] = digits[digest[i] & 15];
    }
    return out;
}

TreeHasher::TreeHasher(const std::vector<std::pair<const uint8_t*, size_t>>& buffers)
    : buffers_(buffers), record_offsets_(buffers.size() + 1, 0) {
    // One flat allocation of per-buffer records: the chunk digests followed by
    // the 8-byte length trailer, i.e. exactly the input of the final hash.
    for (size_t b = 0; b < buffers_.size(); ++b) {
        const size_t size_bytes = buffers_[b].second;
        const size_t chunks = (size_bytes + kTreeHashChunkBytes - 1) / kTreeHashChunkBytes;
        record_offsets_[b + 1] = record_offsets_[b] + chunks * 16 + 8;
        for (size_t offset = 0; offset < size_bytes; offset += kTreeHashChunkBytes)
            chunks_.push_back({b, offset, std::min(kTreeHashChunkBytes, size_bytes - offset)});
    }
    records_.resize(record_offsets_.back());
    digest_out_.reserve(chunks_.size());
    for (const Chunk& c : chunks_)
        digest_out_.push_back(records_.data() + record_offsets_[c.buffer] +
                              16 * (c.offset / kTreeHashChunkBytes));
}

void TreeHasher::hash_chunk(size_t i) {
    const Chunk& c = chunks_[i];
    xxh::store_canonical(xxh::hash128(buffers_[c.buffer].first + c.offset, c.size_bytes),
                         digest_out_[i]);
}

std::vector<Digest> TreeHasher::finish() {
    std::vector<Digest> digests(buffers_.size());
    for (size_t b = 0; b < buffers_.size(); ++b) {
        const size_t chunks = (record_offsets_[b + 1] - record_offsets_[b] - 8) / 16;
        digests[b] = tree_hash_finish(records_.data() + record_offsets_[b], chunks,
                                      buffers_[b].second);
    }
    return digests;
}

std::vector<Digest> tree_hash_many(
    const std::vector<std::pair<const uint8_t*, size_t>>& buffers, unsigned threads) {
    TreeHasher hasher(buffers);
    size_t total_bytes = 0;
    for (const auto& b : buffers) total_bytes += b.second;
    // One worker per full chunk of input at most: under 2 chunks stays on this thread.
    const size_t byte_bound = std::max<size_t>(1, total_bytes / kTreeHashChunkBytes);
    const unsigned workers = unsigned(std::max<size_t>(
        1, std::min({size_t(detail::resolve_threads(threads)), hasher.chunk_count(), byte_bound})));
    // Dynamic claiming keeps threads busy when buffer sizes are very uneven.
    std::atomic<size_t> next{0};
    detail::run_workers(workers, [&](unsigned) {
        for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < hasher.chunk_count();)
            hasher.hash_chunk(i);
    });
    return hasher.finish();
}

Digest tree_hash_finish(uint8_t* record, size_t chunks, uint64_t size_bytes) {
    uint8_t* trailer = record + 16 * chunks;
    for (int i = 0; i < 8; ++i) trailer[i] = uint8_t(size_bytes >> (8 * i));
    Digest digest;
    xxh::store_canonical(XXH3_128bits(record, 16 * chunks + 8), digest.data());
    return digest;
}

struct StreamTreeHasher::State {
    XXH3_state_t chunk;
    size_t in_chunk = 0;   // bytes of the current chunk hashed so far
    uint64_t total = 0;    // bytes since reset
    std::vector<uint8_t> record;  // finished chunks' canonical digests
};

StreamTreeHasher::StreamTreeHasher() : state_(new State) { reset(); }
StreamTreeHasher::~StreamTreeHasher() { delete state_; }

void StreamTreeHasher::reset() {
    XXH3_128bits_reset(&state_->chunk);
    state_->in_chunk = 0;
    state_->total = 0;
    state_->record.clear();
}

void StreamTreeHasher::update(const uint8_t* data, size_t size_bytes) {
    State& s = *state_;
    while (size_bytes > 0) {
        const size_t n = std::min(size_bytes, kTreeHashChunkBytes - s.in_chunk);
        xxh::update128(&s.chunk, data, n);
        s.in_chunk += n;
        s.total += n;
        data += n;
        size_bytes -= n;
        if (s.in_chunk == kTreeHashChunkBytes) {
            const size_t at = s.record.size();
            s.record.resize(at + 16);
            xxh::store_canonical(XXH3_128bits_digest(&s.chunk), s.record.data() + at);
            XXH3_128bits_reset(&s.chunk);
            s.in_chunk = 0;
        }
    }
}

Digest StreamTreeHasher::finish() {
    State& s = *state_;
    // tree_hash has one chunk per started 4 MiB, and none for an empty buffer.
    if (s.in_chunk > 0) {
        const size_t at = s.record.size();
        s.record.resize(at + 16);
        xxh::store_canonical(XXH3_128bits_digest(&s.chunk), s.record.data() + at);
    }
    const size_t chunks = s.record.size() / 16;
    s.record.resize(s.record.size() + 8);
    return tree_hash_finish(s.record.data(), chunks, s.total);
}

Digest tree_hash(const uint8_t* data, size_t size_bytes, unsigned threads) {
    return tree_hash_many({{data, size_bytes}}, threads)[0];
}

}  // namespace tc
