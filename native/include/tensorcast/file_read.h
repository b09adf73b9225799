// Parallel positional reads of file ranges into memory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tensorcast/errors.h"  // ShortFileError, IoError
#include "tensorcast/hash.h"

namespace tc {

constexpr uint64_t kDefaultReadBlockBytes = 8ull << 20;
// Reads wait on the device, not the CPU: more threads than cores keep its queue full.
constexpr unsigned kDefaultReadThreads = 8;

// Bytes of `length_bytes` at `file_offset` of files[file], to be read into dest.
struct FileSpan {
    uint32_t file;
    uint64_t file_offset;
    uint64_t length_bytes;
    uint8_t* dest;
};

// Reads every span, split into blocks of block_bytes spread over `threads` (0 =
// kDefaultReadThreads). A span past the end of its file throws ShortFileError before anything
// is read; a missing file throws IoError.
void read_spans(const std::vector<std::string>& files, const std::vector<FileSpan>& spans,
                unsigned threads, uint64_t block_bytes = kDefaultReadBlockBytes);

// read_spans where each span is one buffer to hash: returns the tree hash of each span, each
// chunk hashed as soon as it is read, by the thread that read it (reading and hashing overlap).
// Spans adjacent in the file and in memory are read as one run.
std::vector<Digest> read_spans_hashed(const std::vector<std::string>& files,
                                      const std::vector<FileSpan>& spans, unsigned threads);

// One range of one file (read_spans of a single span).
void read_file_into(const std::string& path, uint64_t file_offset, uint64_t length_bytes,
                    uint8_t* dest, unsigned threads,
                    uint64_t block_bytes = kDefaultReadBlockBytes);

}  // namespace tc
