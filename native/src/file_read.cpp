#include "tensorcast/file_read.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "parallel.h"

namespace tc {
namespace {

[[noreturn]] void throw_io_error(const std::string& path, const char* what, int error) {
    throw IoError(path + ": " + what + " failed: " + std::strerror(error));
}

[[noreturn]] void throw_short_file(const std::string& path, uint64_t expected_end,
                                   uint64_t actual_size_bytes) {
    throw ShortFileError(path + ": expected at least " + std::to_string(expected_end) +
                         " bytes, file has " + std::to_string(actual_size_bytes));
}

struct FileDescriptor {
    int fd;
    ~FileDescriptor() { ::close(fd); }
};

// Reads exactly length_bytes at file_offset, looping over EINTR and short reads.
void pread_fully(int fd, const std::string& path, uint64_t file_offset, uint64_t length_bytes,
                 uint8_t* dest, uint64_t expected_end) {
    while (length_bytes > 0) {
        const ssize_t n = ::pread(fd, dest, length_bytes, off_t(file_offset));
        if (n < 0) {
            if (errno == EINTR) continue;
            throw_io_error(path, "pread", errno);
        }
        // The file shrank after fstat.
        if (n == 0) throw_short_file(path, expected_end, file_offset);
        file_offset += uint64_t(n);
        length_bytes -= uint64_t(n);
        dest += n;
    }
}

}  // namespace

void read_file_into(const std::string& path, uint64_t file_offset, uint64_t length_bytes,
                    uint8_t* dest, unsigned threads, uint64_t block_bytes) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw_io_error(path, "open", errno);
    const FileDescriptor guard{fd};

    struct stat info;
    if (::fstat(fd, &info) != 0) throw_io_error(path, "fstat", errno);
    const uint64_t size_bytes = uint64_t(info.st_size);
    if (file_offset > size_bytes || length_bytes > size_bytes - file_offset) {
        throw_short_file(path, file_offset + length_bytes, size_bytes);
    }
    if (length_bytes == 0) return;
    // Only a hint; readahead still helps each worker's contiguous block.
    ::posix_fadvise(fd, off_t(file_offset), off_t(length_bytes), POSIX_FADV_SEQUENTIAL);

    block_bytes = std::max<uint64_t>(1, block_bytes);
    const uint64_t blocks = (length_bytes + block_bytes - 1) / block_bytes;
    const unsigned workers =
        unsigned(std::min<uint64_t>(detail::resolve_threads(threads), blocks));
    const uint64_t expected_end = file_offset + length_bytes;
    // Ascending block claims keep the combined access pattern close to sequential.
    std::atomic<uint64_t> next{0};
    std::atomic<bool> failed{false};
    detail::run_workers(workers, [&](unsigned) {
        for (uint64_t b; !failed.load(std::memory_order_relaxed) &&
                         (b = next.fetch_add(1, std::memory_order_relaxed)) < blocks;) {
            const uint64_t offset = b * block_bytes;
            try {
                pread_fully(fd, path, file_offset + offset,
                            std::min(block_bytes, length_bytes - offset), dest + offset,
                            expected_end);
            } catch (...) {
                failed = true;  // stop the other workers early
                throw;
            }
        }
    });
}

}  // namespace tc
