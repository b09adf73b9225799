// Parallel positional reads of a file range into memory.
#pragma once

#include <cstdint>
#include <string>

#include "tensorcast/errors.h"  // ShortFileError, IoError

namespace tc {

constexpr uint64_t kDefaultReadBlockBytes = 8ull << 20;

// Reads [file_offset, file_offset + length_bytes) of `path` into dest, with
// blocks of block_bytes spread over `threads` (0 = hardware concurrency).
void read_file_into(const std::string& path, uint64_t file_offset, uint64_t length_bytes,
                    uint8_t* dest, unsigned threads,
                    uint64_t block_bytes = kDefaultReadBlockBytes);

}  // namespace tc
