// Plain C++ checks of the core (no Python); exits non-zero on any failure.
#include "check.h"
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tensorcast/copy.h"
#include "tensorcast/file_read.h"
#include "tensorcast/hash.h"

namespace {


template <typename Error, typename Fn>
bool throws(Fn&& fn) {
    try {
        fn();
    } catch (const Error&) {
        return true;
    } catch (...) {
    }
    return false;
}

std::vector<uint8_t> random_bytes(size_t size_bytes, unsigned seed) {
    std::mt19937_64 rng(seed);
    std::vector<uint8_t> bytes(size_bytes);
    for (auto& b : bytes) b = uint8_t(rng());
    return bytes;
}

constexpr size_t kChunk = tc::kTreeHashChunkBytes;

void test_hash_thread_independence_and_boundaries() {
    const auto data = random_bytes(3 * kChunk + 5, 1);
    for (size_t size : {size_t(0), size_t(1), kChunk - 1, kChunk, kChunk + 1, 3 * kChunk + 5}) {
        const tc::Digest one = tc::tree_hash(data.data(), size, 1);
        CHECK(tc::tree_hash(data.data(), size, 2) == one);
        CHECK(tc::tree_hash(data.data(), size, 7) == one);
        CHECK(tc::tree_hash(data.data(), size, 0) == one);
        if (size > 0) CHECK(tc::tree_hash(data.data(), size - 1, 1) != one);
    }
}

// Pins the format: values from the Python `xxhash` package applied to the spec.
void test_hash_known_answers() {
    const tc::Digest empty = {0x2c, 0x0a, 0x8a, 0x99, 0xdc, 0x14, 0x7d, 0x54,
                              0x45, 0xc3, 0xb4, 0x9d, 0x03, 0x56, 0x65, 0xb2};
    const tc::Digest hello = {0x1e, 0x14, 0x3c, 0x32, 0xd2, 0x3c, 0xf0, 0x70,
                              0x83, 0x25, 0x9d, 0x8c, 0x35, 0x4d, 0x78, 0x81};
    CHECK(tc::tree_hash(nullptr, 0, 1) == empty);
    CHECK(tc::tree_hash(reinterpret_cast<const uint8_t*>("hello"), 5, 1) == hello);
}

void test_hash_bit_flip() {
    auto data = random_bytes(2 * kChunk + 17, 2);
    const tc::Digest before = tc::tree_hash(data.data(), data.size(), 2);
    data[kChunk + 3] ^= 0x10;
    CHECK(tc::tree_hash(data.data(), data.size(), 2) != before);
}

void test_hash_many_matches_single() {
    const auto data = random_bytes(2 * kChunk + 1000, 3);
    std::vector<std::pair<const uint8_t*, size_t>> buffers;
    // {offset, size}: odd offsets so chunks do not start aligned.
    for (const auto& [offset, size] : std::vector<std::pair<size_t, size_t>>{
             {0, 0}, {3, 7}, {11, 4096}, {0, kChunk}, {5, kChunk + 1}, {0, 2 * kChunk + 1000}})
        buffers.emplace_back(data.data() + offset, size);
    for (unsigned threads : {1u, 2u, 7u}) {
        const auto digests = tc::tree_hash_many(buffers, threads);
        CHECK(digests.size() == buffers.size());
        for (size_t i = 0; i < buffers.size(); ++i)
            CHECK(digests[i] == tc::tree_hash(buffers[i].first, buffers[i].second, 1));
    }
}

struct TempFile {
    std::string path;
    explicit TempFile(const std::vector<uint8_t>& bytes) {
        char name[] = "/tmp/tc_core_test_XXXXXX";
        const int fd = mkstemp(name);
        path = name;
        CHECK(fd >= 0 && write(fd, bytes.data(), bytes.size()) == ssize_t(bytes.size()));
        close(fd);
    }
    ~TempFile() { unlink(path.c_str()); }
};

void test_file_read() {
    const auto bytes = random_bytes(5 * 1000 * 1000 + 3, 4);
    const TempFile file(bytes);
    struct Range { uint64_t offset, length, block; unsigned threads; };
    for (const Range r : {Range{0, bytes.size(), 1 << 20, 3}, Range{7, 4001, 333, 7},
                          Range{12345, 3000001, 65537, 2}, Range{bytes.size() - 1, 1, 8, 4},
                          Range{bytes.size(), 0, 8, 4}, Range{99, 1234567, 8u << 20, 0}}) {
        std::vector<uint8_t> dest(r.length + 2, 0xAB);
        tc::read_file_into(file.path, r.offset, r.length, dest.data() + 1, r.threads, r.block);
        CHECK(std::memcmp(dest.data() + 1, bytes.data() + r.offset, r.length) == 0);
        CHECK(dest.front() == 0xAB && dest.back() == 0xAB);  // nothing written outside
    }
    std::vector<uint8_t> dest(100);
    CHECK(throws<tc::ShortFileError>(
        [&] { tc::read_file_into(file.path, bytes.size() - 50, 100, dest.data(), 2); }));
    CHECK(throws<tc::ShortFileError>(
        [&] { tc::read_file_into(file.path, bytes.size() + 1, 0, dest.data(), 2); }));
    CHECK(throws<tc::IoError>(
        [&] { tc::read_file_into("/nonexistent/tc_core_test", 0, 1, dest.data(), 2); }));
}

// Tensor-like spans (adjacent in the file and in memory, so read as one run), a span elsewhere
// and empty ones: bytes and tree hashes equal the file's, whatever the threads.
void test_read_spans_hashed() {
    const auto bytes = random_bytes(3 * tc::kTreeHashChunkBytes + 12345, 6);
    const TempFile file(bytes);
    struct Span { uint64_t offset, length, dest; };
    const std::vector<Span> spans = {
        {13, 4200000, 13}, {4200013, 100, 4200113}, {4200113, 5000000, 4200213},  // one run
        {9200113, 0, 9200213}, {100, 5000, 9300000}, {bytes.size(), 0, 9400000},
        {bytes.size() - 7, 7, 9400000}};
    std::vector<uint8_t> memory(9500000);
    for (unsigned threads : {1u, 3u, 0u}) {
        std::fill(memory.begin(), memory.end(), 0xAB);
        std::vector<tc::FileSpan> native_spans;
        for (const Span& s : spans)
            native_spans.push_back({0, s.offset, s.length, memory.data() + s.dest});
        const auto digests = tc::read_spans_hashed({file.path}, native_spans, threads);
        CHECK(digests.size() == spans.size());
        for (size_t i = 0; i < spans.size(); ++i) {
            CHECK(std::memcmp(memory.data() + spans[i].dest, bytes.data() + spans[i].offset,
                              spans[i].length) == 0);
            CHECK(digests[i] == tc::tree_hash(bytes.data() + spans[i].offset, spans[i].length, 1));
        }
        CHECK(memory[12] == 0xAB && memory[9200213] == 0xAB);  // nothing written outside
    }
    // A span past the end of its file, or of a file not given, reads nothing.
    CHECK(throws<tc::ShortFileError>([&] {
        tc::read_spans_hashed({file.path}, {{0, bytes.size() - 1, 2, memory.data()}}, 2);
    }));
    CHECK(throws<tc::IoError>([&] { tc::read_spans({file.path}, {{1, 0, 1, memory.data()}}, 2); }));
}

void test_parallel_copy() {
    for (size_t size : {size_t(0), size_t(1), size_t(1000), tc::kParallelCopyMinBytes + 7}) {
        const auto source = random_bytes(size, 5);
        for (unsigned threads : {1u, 3u, 0u}) {
            std::vector<uint8_t> dest(size + 1, 0xCD);
            tc::parallel_copy(dest.data(), source.data(), size, threads);
            CHECK(size == 0 || std::memcmp(dest.data(), source.data(), size) == 0);
            CHECK(dest.back() == 0xCD);
        }
    }
}

}  // namespace

void test_copy_hash_many_hashes_what_it_copied() {
    // Sizes around the 64 KiB pieces and the 4 MiB chunks, enough in total to use threads.
    const std::vector<size_t> sizes = {0, 1, (64 << 10) + 3, kChunk, kChunk + 5, 2 * kChunk + 7};
    std::vector<std::vector<uint8_t>> sources, dests;
    std::vector<tc::CopyJob> jobs;
    for (size_t i = 0; i < sizes.size(); ++i) {
        sources.push_back(random_bytes(sizes[i], unsigned(40 + i)));
        dests.emplace_back(sizes[i] + 1, uint8_t(0xAB));
    }
    for (size_t i = 0; i < sizes.size(); ++i)
        jobs.push_back({dests[i].data(), sources[i].data(), sizes[i]});
    for (unsigned threads : {1u, 3u}) {
        const auto digests = tc::parallel_copy_hash_many(jobs, threads);
        for (size_t i = 0; i < sizes.size(); ++i) {
            CHECK(std::memcmp(dests[i].data(), sources[i].data(), sizes[i]) == 0);
            CHECK(dests[i][sizes[i]] == 0xAB);  // nothing past the copy
            CHECK(digests[i] == tc::tree_hash(sources[i].data(), sizes[i], 1));
        }
    }
}

int main() {
    test_copy_hash_many_hashes_what_it_copied();
    test_hash_thread_independence_and_boundaries();
    test_hash_known_answers();
    test_hash_bit_flip();
    test_hash_many_matches_single();
    test_file_read();
    test_read_spans_hashed();
    test_parallel_copy();
    if (failures != 0) {
        std::fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    std::puts("all tc_core checks passed");
    return 0;
}
