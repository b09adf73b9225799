// tensorcast._native: thin nanobind layer over tc_core. Buffers are taken via
// the CPython buffer API and the GIL is released around all native work.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <utility>
#include <vector>

#include "tensorcast/copy.h"
#include "tensorcast/file_read.h"
#include "tensorcast/hash.h"

namespace nb = nanobind;

namespace {

// Owns a Py_buffer view; released on every path, including exceptions.
class BufferView {
public:
    BufferView(nb::handle object, const char* name, bool writable) {
        // STRIDES (not SIMPLE) so a non-contiguous exporter reports its layout
        // and we can raise ValueError instead of its own BufferError.
        const int flags = PyBUF_STRIDES | (writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(object.ptr(), &view_, flags) != 0) throw nb::python_error();
        if (!PyBuffer_IsContiguous(&view_, 'C')) {
            PyBuffer_Release(&view_);
            throw nb::value_error((std::string(name) + " must be a C-contiguous buffer").c_str());
        }
    }
    BufferView(BufferView&& other) noexcept : view_(other.view_) { other.view_.obj = nullptr; }
    BufferView(const BufferView&) = delete;
    BufferView& operator=(const BufferView&) = delete;
    ~BufferView() {
        if (view_.obj != nullptr) PyBuffer_Release(&view_);
    }

    uint8_t* data() const { return static_cast<uint8_t*>(view_.buf); }
    size_t size_bytes() const { return size_t(view_.len); }

private:
    Py_buffer view_{};
};

nb::bytes to_bytes(const tc::Digest& digest) {
    return nb::bytes(reinterpret_cast<const char*>(digest.data()), digest.size());
}

void check_fits(const char* name, uint64_t offset, uint64_t length_bytes, size_t size_bytes) {
    if (offset > size_bytes || length_bytes > size_bytes - offset) {
        throw nb::value_error((std::string(name) + ": offset " + std::to_string(offset) +
                               " + length " + std::to_string(length_bytes) +
                               " exceeds buffer size " + std::to_string(size_bytes))
                                  .c_str());
    }
}

}  // namespace

NB_MODULE(_native, m) {
    m.doc() = "tensorcast native core: tree hashing, parallel file reads and copies.";
    m.attr("TREE_HASH_CHUNK_BYTES") = tc::kTreeHashChunkBytes;
    m.attr("TREE_HASH_VERSION") = tc::kTreeHashVersion;

    // nanobind tries the most recently registered translator first, so the
    // base must be registered before its subclasses.
    nb::exception<tc::NativeError> native_error(m, "NativeError");
    nb::exception<tc::ShortFileError>(m, "ShortFileError", native_error);
    nb::exception<tc::IoError>(m, "IoError", native_error);

    m.def(
        "hash_buffer",
        [](nb::handle buf, unsigned threads) {
            const BufferView view(buf, "buf", false);
            tc::Digest digest;
            {
                nb::gil_scoped_release release;
                digest = tc::tree_hash(view.data(), view.size_bytes(), threads);
            }
            return to_bytes(digest);
        },
        nb::arg("buf"), nb::arg("threads") = 0,
        "TC tree hash v1 (16 bytes) of a C-contiguous buffer; threads=0 uses all cores.");

    m.def(
        "hash_buffers",
        [](nb::sequence bufs, unsigned threads) {
            const size_t count = nb::len(bufs);
            std::vector<BufferView> views;
            std::vector<std::pair<const uint8_t*, size_t>> buffers;
            views.reserve(count);
            buffers.reserve(count);
            for (nb::handle buf : bufs) {
                views.emplace_back(buf, "each item of bufs", false);
                buffers.emplace_back(views.back().data(), views.back().size_bytes());
            }
            std::vector<tc::Digest> digests;
            {
                nb::gil_scoped_release release;
                digests = tc::tree_hash_many(buffers, threads);
            }
            nb::list result;
            for (const auto& digest : digests) result.append(to_bytes(digest));
            return result;
        },
        nb::arg("bufs"), nb::arg("threads") = 0,
        "hash_buffer for many buffers at once, sharing one pool of threads.");

    m.def(
        "read_file_into",
        [](const std::string& path, uint64_t file_offset, uint64_t length, nb::handle dest,
           uint64_t dest_offset, unsigned threads) {
            const BufferView view(dest, "dest", true);
            check_fits("dest", dest_offset, length, view.size_bytes());
            nb::gil_scoped_release release;
            tc::read_file_into(path, file_offset, length, view.data() + dest_offset, threads);
        },
        nb::arg("path"), nb::arg("file_offset"), nb::arg("length"), nb::arg("dest"),
        nb::arg("dest_offset"), nb::arg("threads") = 0,
        "Read length bytes at file_offset of path into dest[dest_offset:].");

    m.def(
        "copy_into",
        [](nb::handle dest, uint64_t dest_offset, nb::handle source, unsigned threads) {
            const BufferView dest_view(dest, "dest", true);
            const BufferView source_view(source, "source", false);
            const size_t size_bytes = source_view.size_bytes();
            check_fits("dest", dest_offset, size_bytes, dest_view.size_bytes());
            uint8_t* target = dest_view.data() + dest_offset;
            const uint8_t* origin = source_view.data();
            // Parallel memcpy has no defined result for overlapping ranges.
            if (size_bytes > 0 && target < origin + size_bytes && origin < target + size_bytes)
                throw nb::value_error("copy_into: dest and source overlap");
            nb::gil_scoped_release release;
            tc::parallel_copy(target, origin, size_bytes, threads);
        },
        nb::arg("dest"), nb::arg("dest_offset"), nb::arg("source"), nb::arg("threads") = 0,
        "Copy all of source into dest[dest_offset:], in parallel for large sizes.");
}
