#include "tensorcast/file_read.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>

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

struct OpenFile {
    std::string path;
    int fd = -1;
    uint64_t size_bytes = 0;

    explicit OpenFile(const std::string& p) : path(p) {
        fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) throw_io_error(path, "open", errno);
        struct stat info;
        if (::fstat(fd, &info) != 0) {
            const int error = errno;
            ::close(fd);
            throw_io_error(path, "fstat", error);
        }
        size_bytes = uint64_t(info.st_size);
    }
    OpenFile(const OpenFile&) = delete;
    OpenFile& operator=(const OpenFile&) = delete;
    ~OpenFile() { ::close(fd); }

    // Exactly length_bytes at offset, over EINTR and short reads.
    void read(uint64_t offset, uint64_t length_bytes, uint8_t* dest) const {
        const uint64_t expected_end = offset + length_bytes;
        while (length_bytes > 0) {
            const ssize_t n = ::pread(fd, dest, length_bytes, off_t(offset));
            if (n < 0) {
                if (errno == EINTR) continue;
                throw_io_error(path, "pread", errno);
            }
            if (n == 0) throw_short_file(path, expected_end, offset);  // shrank since fstat
            offset += uint64_t(n);
            length_bytes -= uint64_t(n);
            dest += n;
        }
    }
};

class OpenFiles {
public:
    OpenFiles(const std::vector<std::string>& paths, const std::vector<FileSpan>& spans) {
        files_.reserve(paths.size());
        for (const auto& path : paths) files_.push_back(std::make_unique<OpenFile>(path));
        for (const FileSpan& span : spans) {
            if (span.file >= files_.size()) throw IoError("span names file " +
                                                          std::to_string(span.file) + " of " +
                                                          std::to_string(files_.size()));
            const OpenFile& f = *files_[span.file];
            if (span.file_offset > f.size_bytes || span.length_bytes > f.size_bytes - span.file_offset)
                throw_short_file(f.path, span.file_offset + span.length_bytes, f.size_bytes);
        }
    }

    void read(const FileSpan& span, uint64_t offset, uint64_t length_bytes) const {
        files_[span.file]->read(span.file_offset + offset, length_bytes, span.dest + offset);
    }

private:
    std::vector<std::unique_ptr<OpenFile>> files_;
};

unsigned read_threads(unsigned threads) { return threads != 0 ? threads : kDefaultReadThreads; }

// A piece of runs[run] to read as one: [offset, offset + length_bytes) of the run.
struct Block {
    size_t run;
    uint64_t offset, length_bytes;
};

// Blocks end on file offsets that are multiples of block_bytes. Ascending, run by run.
std::vector<Block> cut_blocks(const std::vector<FileSpan>& runs, uint64_t block_bytes) {
    block_bytes = std::max<uint64_t>(1, block_bytes);
    std::vector<Block> blocks;
    for (size_t r = 0; r < runs.size(); ++r) {
        for (uint64_t done = 0; done < runs[r].length_bytes;) {
            const uint64_t at = runs[r].file_offset + done;
            const uint64_t step =
                std::min(block_bytes - at % block_bytes, runs[r].length_bytes - done);
            blocks.push_back({r, done, step});
            done += step;
        }
    }
    return blocks;
}

// Reads every block on `threads` workers, claimed in ascending order (the combined access
// pattern stays close to sequential); after_read(b) runs on the thread that read block b.
template <typename AfterRead>
void read_blocks(const OpenFiles& open, const std::vector<FileSpan>& runs,
                 const std::vector<Block>& blocks, unsigned threads, const AfterRead& after_read) {
    const unsigned workers = unsigned(std::min<size_t>(read_threads(threads), blocks.size()));
    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};
    detail::run_workers(std::max(1u, workers), [&](unsigned) {
        for (size_t b; !failed.load(std::memory_order_relaxed) &&
                       (b = next.fetch_add(1, std::memory_order_relaxed)) < blocks.size();) {
            try {
                open.read(runs[blocks[b].run], blocks[b].offset, blocks[b].length_bytes);
                after_read(b);
            } catch (...) {
                failed = true;  // stop the other workers early
                throw;
            }
        }
    });
}

}  // namespace

void read_spans(const std::vector<std::string>& files, const std::vector<FileSpan>& spans,
                unsigned threads, uint64_t block_bytes) {
    const OpenFiles open(files, spans);
    read_blocks(open, spans, cut_blocks(spans, block_bytes), threads, [](size_t) {});
}

std::vector<Digest> read_spans_hashed(const std::vector<std::string>& files,
                                      const std::vector<FileSpan>& spans, unsigned threads) {
    const OpenFiles open(files, spans);
    std::vector<std::pair<const uint8_t*, size_t>> buffers;
    buffers.reserve(spans.size());
    for (const FileSpan& span : spans) buffers.emplace_back(span.dest, span.length_bytes);
    TreeHasher hasher(buffers);

    // Spans that follow each other in the file and in memory (a shard's tensors) are read as
    // one run, in blocks that ignore tensor boundaries (a block per tensor edge would cost a
    // request per edge).
    std::vector<FileSpan> runs;
    std::vector<size_t> run_of(spans.size());
    for (size_t s = 0; s < spans.size(); ++s) {
        const FileSpan& span = spans[s];
        if (!runs.empty()) {
            FileSpan& last = runs.back();
            if (last.file == span.file && last.file_offset + last.length_bytes == span.file_offset &&
                last.dest + last.length_bytes == span.dest) {
                last.length_bytes += span.length_bytes;
                run_of[s] = runs.size() - 1;
                continue;
            }
        }
        run_of[s] = runs.size();
        runs.push_back(span);
    }
    const std::vector<Block> blocks = cut_blocks(runs, kTreeHashChunkBytes);

    // A chunk is hashed by the thread that reads the last block it overlaps.
    std::vector<std::vector<size_t>> chunks_of_block(blocks.size());
    std::vector<std::atomic<uint32_t>> waiting(hasher.chunk_count());
    for (size_t c = 0; c < hasher.chunk_count(); ++c) {
        const TreeHasher::Chunk& chunk = hasher.chunk(c);
        const size_t r = run_of[chunk.buffer];
        const uint64_t begin = uint64_t(spans[chunk.buffer].dest - runs[r].dest) + chunk.offset;
        const uint64_t end = begin + chunk.size_bytes;
        auto b = std::partition_point(blocks.begin(), blocks.end(), [&](const Block& block) {
            return block.run < r || (block.run == r && block.offset + block.length_bytes <= begin);
        });
        for (; b != blocks.end() && b->run == r && b->offset < end; ++b) {
            chunks_of_block[size_t(b - blocks.begin())].push_back(c);
            waiting[c].fetch_add(1, std::memory_order_relaxed);
        }
    }
    read_blocks(open, runs, blocks, threads, [&](size_t b) {
        for (size_t c : chunks_of_block[b])
            if (waiting[c].fetch_sub(1, std::memory_order_acq_rel) == 1) hasher.hash_chunk(c);
    });
    return hasher.finish();
}

void read_file_into(const std::string& path, uint64_t file_offset, uint64_t length_bytes,
                    uint8_t* dest, unsigned threads, uint64_t block_bytes) {
    read_spans({path}, {{0, file_offset, length_bytes, dest}}, threads, block_bytes);
}

}  // namespace tc
