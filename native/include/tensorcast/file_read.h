// Parallel positional reads of a file range into memory.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace tc {

struct NativeError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// The file ends before the requested range does.
struct ShortFileError : NativeError {
    using NativeError::NativeError;
};

// open/fstat/pread failed; the message carries the path and strerror.
struct IoError : NativeError {
    using NativeError::NativeError;
};

constexpr uint64_t kDefaultReadBlockBytes = 8ull << 20;

// Reads [file_offset, file_offset + length_bytes) of `path` into dest, with
// blocks of block_bytes spread over `threads` (0 = hardware concurrency).
void read_file_into(const std::string& path, uint64_t file_offset, uint64_t length_bytes,
                    uint8_t* dest, unsigned threads,
                    uint64_t block_bytes = kDefaultReadBlockBytes);

}  // namespace tc
