// TC tree hash v1: XXH3-128 over fixed-size chunks, then over the chunk digests.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tc {

constexpr size_t kTreeHashChunkBytes = 4194304;  // 4 MiB; part of the format
constexpr unsigned kTreeHashVersion = 1;

using Digest = std::array<uint8_t, 16>;  // canonical (big-endian) XXH128

std::string hex(const Digest& digest);  // 32 lowercase hex digits

// Digest = XXH3_128(canonical(chunk_0) .. canonical(chunk_n-1) || le64(size)).
// The result never depends on `threads` (0 = hardware concurrency).
Digest tree_hash(const uint8_t* data, size_t size_bytes, unsigned threads);

// The last step of the tree hash, for callers that hash the chunks themselves: `record` holds
// `chunks` canonical chunk digests (16 bytes each) followed by 8 free bytes, where the length
// trailer is written.
Digest tree_hash_finish(uint8_t* record, size_t chunks, uint64_t size_bytes);

// The tree hashes of many buffers, one chunk at a time in any order, on any thread (distinct
// chunks concurrently): for callers that produce the bytes themselves and hash each chunk as
// soon as it is there (a reader hashing what it just read).
class TreeHasher {
public:
    struct Chunk {
        size_t buffer;
        size_t offset;
        size_t size_bytes;
    };

    explicit TreeHasher(const std::vector<std::pair<const uint8_t*, size_t>>& buffers);
    size_t chunk_count() const { return chunks_.size(); }
    const Chunk& chunk(size_t i) const { return chunks_[i]; }
    void hash_chunk(size_t i);
    std::vector<Digest> finish();  // once every chunk is hashed

private:
    std::vector<std::pair<const uint8_t*, size_t>> buffers_;
    std::vector<Chunk> chunks_;
    std::vector<size_t> record_offsets_;  // per buffer: its chunk digests, then 8 free bytes
    std::vector<uint8_t*> digest_out_;    // per chunk: where its digest goes
    std::vector<uint8_t> records_;
};

// The tree hash of one buffer fed in pieces as it arrives (a page received from a socket):
// same digest as tree_hash, whatever the pieces.
class StreamTreeHasher {
public:
    StreamTreeHasher();
    ~StreamTreeHasher();
    StreamTreeHasher(const StreamTreeHasher&) = delete;
    StreamTreeHasher& operator=(const StreamTreeHasher&) = delete;

    void reset();
    void update(const uint8_t* data, size_t size_bytes);
    Digest finish();  // of everything given since reset(); then reset() before the next

private:
    struct State;
    State* state_;
};

// Same digests as tree_hash on each buffer, but all chunks of all buffers share
// one worker pool so many small buffers cost no per-buffer thread start.
std::vector<Digest> tree_hash_many(
    const std::vector<std::pair<const uint8_t*, size_t>>& buffers, unsigned threads);

}  // namespace tc
