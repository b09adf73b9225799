// tensorcast._native: thin nanobind layer over tc_core. Buffers are taken via
// the CPython buffer API and the GIL is released around all native work.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/set.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "tensorcast/arena.h"
#include "tensorcast/copy.h"
#include "tensorcast/file_read.h"
#include "tensorcast/hash.h"
#include "tensorcast/page_client.h"
#include "tensorcast/page_directory.h"
#include "tensorcast/page_index.h"
#include "tensorcast/page_remote.h"
#include "tensorcast/page_server.h"
#include "tensorcast/transport.h"

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

nb::list to_list(const std::vector<tc::Digest>& digests) {
    nb::list result;
    for (const auto& digest : digests) result.append(to_bytes(digest));
    return result;
}

void check_fits(const char* name, uint64_t offset, uint64_t length_bytes, size_t size_bytes) {
    if (offset > size_bytes || length_bytes > size_bytes - offset) {
        throw nb::value_error((std::string(name) + ": offset " + std::to_string(offset) +
                               " + length " + std::to_string(length_bytes) +
                               " exceeds buffer size " + std::to_string(size_bytes))
                                  .c_str());
    }
}

// [ca, cert, key] from Python (empty: plaintext).
tc::TlsFiles tls_files(const std::vector<std::string>& paths) {
    if (paths.empty()) return {};
    if (paths.size() != 3 || paths[0].empty())
        throw std::invalid_argument("tls: give [ca, cert, key] PEM paths, or nothing");
    return tc::TlsFiles{paths[0], paths[1], paths[2]};
}

// Python face of tc::DataServer. Holds the buffer export of `base` (which also
// keeps the exporting object alive, and stops an mmap from being closed) until
// stop(); the C++ server only reads the memory while its threads run.
class PyDataServer {
public:
    PyDataServer(const std::string& host, uint16_t port, nb::handle base, const std::string& token,
                 const tc::TlsFiles& tls)
        : view_(std::make_unique<BufferView>(base, "base", false)),
          server_(std::make_unique<tc::DataServer>(host, port, view_->data(),
                                                   view_->size_bytes(), token, tls)) {}
    ~PyDataServer() { server_->stop(); }  // before view_ goes (members die in reverse)

    tc::DataServer& server() { return *server_; }

    void serve_pages(std::shared_ptr<tc::RemotePageService> pages) {
        pages_ = pages;
        server_->serve_pages(std::move(pages));
    }
    tc::RemotePageService* pages() { return pages_.get(); }

    void stop() {
        {
            nb::gil_scoped_release release;
            server_->stop();
        }
        view_.reset();  // threads are joined: the memory is no longer read
    }

private:
    std::unique_ptr<BufferView> view_;
    std::unique_ptr<tc::DataServer> server_;
    std::shared_ptr<tc::RemotePageService> pages_;
};

// A page as Python sees it: (key, shard, token, dtype, shape, offset, size_bytes, hash,
// expires_at, ttl_s, home).
using PyPage = std::tuple<std::string, uint32_t, uint64_t, std::string, std::vector<int64_t>,
                          uint64_t, uint64_t, std::string, double, double, bool>;
using PyPageWrite = std::tuple<std::string, uint32_t, uint64_t, std::string, std::vector<int64_t>,
                               uint64_t, uint64_t, std::string>;

std::vector<tc::PageKey> page_keys(
    const std::vector<std::tuple<std::string, uint32_t, uint64_t>>& keys) {
    std::vector<tc::PageKey> out;
    out.reserve(keys.size());
    for (const auto& [key, shard, token] : keys) out.push_back({key, shard, token});
    return out;
}

std::vector<tc::PageWrite> page_writes(const std::vector<PyPageWrite>& writes) {
    std::vector<tc::PageWrite> out(writes.size());
    for (size_t i = 0; i < writes.size(); ++i) {
        tc::PageWrite& n = out[i];
        std::tie(n.key, n.shard, n.token, n.dtype, n.shape, n.offset, n.size_bytes, n.hash) =
            writes[i];
    }
    return out;
}

// Where a page lies and what it is, as Python sees it: (offset, size_bytes, dtype, shape,
// hash), or None. `Found` is a directory hit or a page the worker described.
template <typename Found>
nb::object found_to_py(const std::optional<Found>& page) {
    if (!page) return nb::none();
    nb::list shape;
    for (int64_t d : page->shape) shape.append(d);
    return nb::make_tuple(page->offset, page->size_bytes, page->dtype, nb::tuple(shape),
                          page->hash);
}

PyPage to_py(const tc::Page& p) {
    return {p.key, p.shard, p.token, p.dtype, p.shape, p.offset, p.size_bytes, p.hash,
            p.expires_at, p.ttl_s, p.home};
}

// Python face of tc::PageIndex over the pool's memory. Holds the buffer export of `base` until
// close() (so the pool's mmap cannot be closed under it) and the lease fallback callable.
class PyPageIndex {
public:
    PyPageIndex(nb::handle base, std::shared_ptr<tc::ArenaAllocator> arena,
                std::map<std::string, uint64_t> itemsizes)
        : view_(std::make_unique<BufferView>(base, "base", true)),
          index_(std::make_shared<tc::PageIndex>(view_->data(), std::move(arena),
                                                 std::move(itemsizes))) {}

    tc::PageIndex& index() { return *index_; }
    std::shared_ptr<tc::PageIndex> shared() { return index_; }

    // `fn(list of (shard, token))` runs (with the GIL) when an operation names leases the
    // index does not hold as named; it raises to refuse. Its exception becomes the error the
    // caller sees.
    void set_lease_fallback(nb::object fn) {
        PyObject* raw = fn.ptr();  // kept alive by fallback_ below until close()
        index_->set_lease_fallback(
            [raw](const std::vector<std::pair<uint32_t, uint64_t>>& shard_tokens) {
                std::string kind, message;
                {
                    nb::gil_scoped_acquire gil;
                    try {
                        nb::list named;
                        for (const auto& [shard, token] : shard_tokens)
                            named.append(nb::make_tuple(shard, token));
                        const nb::handle fn(raw);
                        fn(named);
                        return;
                    } catch (nb::python_error& e) {
                        kind = nb::cast<std::string>(nb::handle(e.type()).attr("__name__"));
                        message = nb::cast<std::string>(nb::str(e.value()));
                    }
                }
                throw tc::StatusError(kind, message);
            });
        fallback_ = std::move(fn);
    }

    void close() {
        index_->set_lease_fallback(nullptr);
        fallback_ = nb::object();
        view_.reset();
    }

private:
    std::unique_ptr<BufferView> view_;
    std::shared_ptr<tc::PageIndex> index_;
    nb::object fallback_;
};

// Copy jobs for copy_many / copy_hash_many; `views` keeps the buffers exported meanwhile.
std::vector<tc::CopyJob> copy_jobs(nb::sequence dests, nb::sequence sources,
                                   std::vector<BufferView>& views) {
    const size_t count = nb::len(dests);
    if (nb::len(sources) != count)
        throw nb::value_error("copy_many: dests and sources differ in length");
    views.reserve(2 * count);
    std::vector<tc::CopyJob> jobs;
    jobs.reserve(count);
    for (size_t i = 0; i < count; ++i) {
        views.emplace_back(dests[i], "each dest", true);
        const BufferView& dest = views.back();
        views.emplace_back(sources[i], "each source", false);
        const BufferView& source = views.back();
        check_fits("dest", 0, source.size_bytes(), dest.size_bytes());
        const uint8_t* origin = source.data();
        uint8_t* target = dest.data();
        const size_t n = source.size_bytes();
        if (n > 0 && target < origin + n && origin < target + n)
            throw nb::value_error("copy_many: a dest overlaps its source");
        jobs.push_back(tc::CopyJob{target, origin, n});
    }
    return jobs;
}

// Raises the tensorcast.errors class a StatusError names.
void translate_status_error(const std::exception_ptr& error, void*) {
    try {
        std::rethrow_exception(error);
    } catch (const tc::StatusError& e) {
        nb::object made = nb::module_::import_("tensorcast.errors")
                              .attr("error_named")(e.kind, std::string(e.what()));
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(made.ptr())), made.ptr());
    }
}

struct CancelToken {
    std::atomic<bool> flag{false};
};

// Exception types, filled in at module init; kept alive by the module.
struct TransferErrorTypes {
    PyObject* error = nullptr;
    PyObject* timeout = nullptr;
    PyObject* cancelled = nullptr;
};
TransferErrorTypes transfer_error_types;

// Like nb::exception's translator, plus a `reason` attribute ("refused",
// "bad_token", "ticket_rejected", ...) so Python can branch without parsing text.
void translate_transfer_error(const std::exception_ptr& error, void*) {
    try {
        std::rethrow_exception(error);
    } catch (const tc::TransferError& e) {
        PyObject* type = transfer_error_types.error;
        if (dynamic_cast<const tc::TransferTimeout*>(&e) != nullptr)
            type = transfer_error_types.timeout;
        else if (dynamic_cast<const tc::TransferCancelled*>(&e) != nullptr)
            type = transfer_error_types.cancelled;
        nb::object instance = nb::borrow(type)(nb::str(e.what()));
        nb::setattr(instance, "reason", nb::str(e.reason()));
        PyErr_SetObject(type, instance.ptr());
    }
}

nb::dict to_dict(const tc::PullStats& s) {
    nb::dict d;
    d["bytes"] = s.bytes;
    d["chunks"] = s.chunks;
    d["retries"] = s.retries;
    d["checksum_failures"] = s.checksum_failures;
    d["reconnects"] = s.reconnects;
    d["streams"] = s.streams;
    d["elapsed_ms"] = s.elapsed_ms;
    return d;
}

nb::dict to_dict(const tc::DataServerStats& s) {
    nb::dict d;
    d["bytes_sent"] = s.bytes_sent;
    d["chunks_sent"] = s.chunks_sent;
    d["active_connections"] = s.active_connections;
    d["connections_accepted"] = s.connections_accepted;
    d["connections_refused"] = s.connections_refused;
    d["connections_evicted"] = s.connections_evicted;
    d["errors_sent"] = s.errors_sent;
    return d;
}

using PyHome = std::tuple<std::string, uint16_t, std::vector<size_t>>;

std::vector<tc::RemoteHome> remote_homes(const std::vector<PyHome>& homes) {
    std::vector<tc::RemoteHome> out;
    out.reserve(homes.size());
    for (const auto& [host, port, pages] : homes) out.push_back({host, port, pages});
    return out;
}

tc::RemoteOptions remote_options(const std::string& token, const std::vector<std::string>& tls,
                                 uint32_t timeout_ms, uint32_t streams) {
    tc::RemoteOptions o;
    o.token = token;
    o.tls = tls_files(tls);
    o.timeout_ms = timeout_ms;
    o.streams = streams;
    return o;
}

// Per home: None, or (error class name, message).
nb::list home_errors(const std::vector<std::optional<tc::HomeError>>& errors) {
    nb::list out;
    for (const auto& e : errors)
        out.append(e ? nb::object(nb::make_tuple(e->kind, e->message)) : nb::none());
    return out;
}

nb::object page_info_to_py(const std::optional<tc::PageWrite>& page) {
    if (!page) return nb::none();
    nb::list shape;
    for (int64_t d : page->shape) shape.append(d);
    return nb::make_tuple(page->offset, page->size_bytes, page->dtype, nb::tuple(shape),
                          page->hash);
}

}  // namespace

NB_MODULE(_native, m) {
    m.doc() = "tensorcast native core: tree hashing, parallel file reads and copies, data plane.";
    m.attr("TREE_HASH_CHUNK_BYTES") = tc::kTreeHashChunkBytes;
    m.attr("TREE_HASH_VERSION") = tc::kTreeHashVersion;

    // nanobind tries the most recently registered translator first, so the
    // base must be registered before its subclasses.
    nb::exception<tc::NativeError> native_error(m, "NativeError");
    nb::exception<tc::ShortFileError>(m, "ShortFileError", native_error);
    nb::exception<tc::IoError>(m, "IoError", native_error);
    nb::exception<tc::TransferError> transfer_error(m, "TransferError", native_error);
    nb::exception<tc::TransferTimeout> transfer_timeout(m, "TransferTimeout", transfer_error);
    nb::exception<tc::TransferCancelled> transfer_cancelled(m, "TransferCancelled",
                                                            transfer_error);
    transfer_error_types = {transfer_error.ptr(), transfer_timeout.ptr(),
                            transfer_cancelled.ptr()};
    // Registered last, so tried first: adds `.reason` to the three above.
    nb::register_exception_translator(translate_transfer_error);
    nb::register_exception_translator(translate_status_error);
    // Workers exit with daemon threads still holding native objects (servers, the page index);
    // the OS reclaims them, and nanobind's shutdown report would only bury the real log lines.
    nb::set_leak_warnings(false);

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
            return to_list(digests);
        },
        nb::arg("bufs"), nb::arg("threads") = 0,
        "hash_buffer for many buffers at once, sharing one pool of threads.");

    m.def(
        "read_files",
        [](const std::vector<std::string>& files,
           const std::vector<std::tuple<uint32_t, uint64_t, uint64_t, uint64_t>>& spans,
           nb::handle dest, bool hash, unsigned threads) {
            const BufferView view(dest, "dest", true);
            std::vector<tc::FileSpan> native_spans;
            native_spans.reserve(spans.size());
            for (const auto& [file, file_offset, length, dest_offset] : spans) {
                check_fits("dest", dest_offset, length, view.size_bytes());
                native_spans.push_back({file, file_offset, length, view.data() + dest_offset});
            }
            std::vector<tc::Digest> digests;
            {
                nb::gil_scoped_release release;
                if (hash)
                    digests = tc::read_spans_hashed(files, native_spans, threads);
                else
                    tc::read_spans(files, native_spans, threads);
            }
            return hash ? nb::object(to_list(digests)) : nb::none();
        },
        nb::arg("files"), nb::arg("spans"), nb::arg("dest"), nb::arg("hash") = false,
        nb::arg("threads") = 0,
        "Read spans (file index, file offset, length, dest offset) of files into dest; with "
        "hash, return the tree hash of each span (else None).");

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

    m.def(
        "copy_many",
        [](nb::sequence dests, nb::sequence sources, unsigned threads) {
            std::vector<BufferView> views;
            const auto jobs = copy_jobs(dests, sources, views);
            nb::gil_scoped_release release;
            tc::parallel_copy_many(jobs, threads);
        },
        nb::arg("dests"), nb::arg("sources"), nb::arg("threads") = 0,
        "Copy each source into the start of its dest, the batch spread over threads.");

    m.def(
        "copy_hash_many",
        [](nb::sequence dests, nb::sequence sources, unsigned threads) {
            std::vector<BufferView> views;
            const auto jobs = copy_jobs(dests, sources, views);
            std::vector<tc::Digest> digests;
            {
                nb::gil_scoped_release release;
                digests = tc::parallel_copy_hash_many(jobs, threads);
            }
            return to_list(digests);
        },
        nb::arg("dests"), nb::arg("sources"), nb::arg("threads") = 0,
        "copy_many, returning the tree hash of each copy (computed while it is in cache).");

    m.attr("DATA_PLANE_DEFAULT_STREAMS") = tc::kDefaultPullStreams;
    m.attr("MAX_PAGE_BATCH") = tc::kMaxPageBatch;
    m.attr("DATA_PLANE_DEFAULT_CHUNK_BYTES") = tc::kDefaultPullChunkBytes;

    nb::class_<CancelToken>(m, "CancelToken",
                            "Pass as pull(cancel=...); cancel() from any thread stops the pull "
                            "within ~50 ms with TransferCancelled.")
        .def(nb::init<>())
        .def("cancel", [](CancelToken& t) { t.flag = true; })
        .def_prop_ro("cancelled", [](const CancelToken& t) { return t.flag.load(); });

    nb::class_<PyDataServer>(m, "DataServer",
                             "Serves ticketed reads of `base` (a buffer, e.g. the pool mmap) to "
                             "pull() clients holding `token`. Thread-safe.")
        .def(
            "__init__",
            [](PyDataServer* self, const std::string& host, uint16_t port, nb::handle base,
               const std::string& token, const std::vector<std::string>& tls) {
                new (self) PyDataServer(host, port, base, token, tls_files(tls));
            },
            nb::arg("host"), nb::arg("port"), nb::arg("base"), nb::arg("token"),
            nb::arg("tls") = std::vector<std::string>{},
            "`tls`: [ca, cert, key] PEM paths for mutual TLS, or empty for plaintext.")
        .def_prop_ro("port", [](PyDataServer& s) { return s.server().port(); })
        .def(
            "open_ticket",
            [](PyDataServer& s, uint64_t offset, uint64_t length, uint32_t ttl_ms) {
                return s.server().open_ticket(offset, length, ttl_ms);
            },
            nb::arg("offset"), nb::arg("length"), nb::arg("ttl_ms"),
            "Allow reads of base[offset:offset+length] for ttl_ms; returns the ticket id.")
        .def(
            "close_ticket", [](PyDataServer& s, uint64_t id) { s.server().close_ticket(id); },
            nb::arg("id"))
        .def(
            "begin_growing",
            [](PyDataServer& s, uint64_t offset, uint64_t length) {
                s.server().begin_growing(offset, length);
            },
            nb::arg("offset"), nb::arg("length"),
            "Mark [offset, +length) as being received: READs past what has arrived wait for "
            "it (pull(relay=...) advances it).")
        .def(
            "end_growing", [](PyDataServer& s, uint64_t offset) { s.server().end_growing(offset); },
            nb::arg("offset"), "Lift the wait on the growing range at offset (done or abandoned).")
        .def(
            "idle_tickets",
            [](PyDataServer& s, uint32_t idle_ms) { return s.server().idle_tickets(idle_ms); },
            nb::arg("idle_ms"), "Ids of tickets not read for idle_ms (opened or last READ).")
        .def(
            "inject_corrupt_chunks",
            [](PyDataServer& s, uint32_t n) { s.server().inject_corrupt_chunks(n); }, nb::arg("n"),
            "Test hook: the next n DATA frames carry a wrong checksum.")
        .def(
            "inject_close_after_chunks",
            [](PyDataServer& s, uint32_t n) { s.server().inject_close_after_chunks(n); },
            nb::arg("n"), "Test hook: reset the connection that sends the n-th next chunk.")
        .def("stats", [](PyDataServer& s) { return to_dict(s.server().stats()); })
        .def(
            "serve_pages",
            [](PyDataServer& s, PyPageIndex& index, const std::string& token,
               uint64_t arena_bytes) {
                s.serve_pages(
                    std::make_shared<tc::RemotePageService>(index.shared(), token, arena_bytes));
            },
            nb::arg("index"), nb::arg("token"), nb::arg("arena_bytes"),
            "Serve the index's KV pages to callers on other hosts on this port.")
        .def("page_stats",
             [](PyDataServer& s) {
                 nb::dict d;
                 if (s.pages() == nullptr) return d;
                 const tc::RemotePageStats st = s.pages()->stats();
                 d["requests"] = st.requests;
                 d["errors_sent"] = st.errors_sent;
                 d["bytes_received"] = st.bytes_received;
                 d["bytes_sent"] = st.bytes_sent;
                 d["active_connections"] = st.active_connections;
                 return d;
             })
        .def(
            "inject_corrupt_pages",
            [](PyDataServer& s, uint32_t n) {
                if (s.pages() != nullptr) s.pages()->inject_corrupt_pages(n);
            },
            nb::arg("n"), "Test hook: the next n pages read remotely carry a wrong hash.")
        .def("stop", &PyDataServer::stop,
             "Close the listener and all connections, join threads, release base. Idempotent.");

    m.def(
        "pull",
        [](const std::string& host, uint16_t port, const std::string& token, uint64_t ticket,
           uint64_t source_offset, uint64_t length, nb::handle dest, uint64_t dest_offset,
           uint32_t streams, uint64_t chunk_bytes, uint32_t timeout_ms, CancelToken* cancel,
           const std::vector<std::string>& tls, PyDataServer* relay, uint64_t relay_offset) {
            const tc::TlsFiles files = tls_files(tls);
            const BufferView view(dest, "dest", true);
            check_fits("dest", dest_offset, length, view.size_bytes());
            std::function<void(uint64_t)> on_prefix;
            if (relay != nullptr)
                on_prefix = [&server = relay->server(), relay_offset](uint64_t received) {
                    server.advance_growing(relay_offset, received);
                };
            tc::PullStats stats;
            {
                nb::gil_scoped_release release;
                stats = tc::pull(host, port, token, ticket, source_offset, length,
                                 view.data() + dest_offset, streams, chunk_bytes, timeout_ms,
                                 cancel != nullptr ? &cancel->flag : nullptr, files, on_prefix);
            }
            return to_dict(stats);
        },
        nb::arg("host"), nb::arg("port"), nb::arg("token"), nb::arg("ticket"),
        nb::arg("source_offset"), nb::arg("length"), nb::arg("dest"), nb::arg("dest_offset"),
        nb::arg("streams") = 0, nb::arg("chunk_bytes") = 0, nb::arg("timeout_ms") = 30000,
        nb::kw_only(), nb::arg("cancel").none() = nb::none(),
        nb::arg("tls") = std::vector<std::string>{}, nb::arg("relay").none() = nb::none(),
        nb::arg("relay_offset") = 0,
        "Pull length bytes at source_offset of a DataServer's pool into dest[dest_offset:] over "
        "`streams` TCP connections; returns stats. With `relay`, advances that server's growing "
        "range at relay_offset as the verified prefix grows. Raises TransferError (.reason), "
        "TransferTimeout, TransferCancelled.");

    m.attr("REMOTE_PAGE_STREAMS") = tc::kDefaultRemoteStreams;

    m.def(
        "remote_get",
        [](const std::vector<std::tuple<std::string, uint32_t, uint64_t>>& keys,
           const std::vector<PyHome>& homes, nb::object into, const std::string& token,
           const std::vector<std::string>& tls, uint32_t timeout_ms, uint32_t streams) {
            const auto native = page_keys(keys);
            const auto targets = remote_homes(homes);
            const auto options = remote_options(token, tls, timeout_ms, streams);
            std::vector<BufferView> views;
            const bool given = !into.is_none();
            if (given) {
                const nb::sequence buffers = nb::borrow<nb::sequence>(into);
                if (nb::len(buffers) != native.size())
                    throw nb::value_error("remote_get: `into` needs one buffer per key");
                views.reserve(native.size());
                for (nb::handle b : buffers) views.emplace_back(b, "each into buffer", true);
            }
            std::vector<nb::object> made(native.size());  // new bytearrays (no `into`)
            tc::PageSink sink;
            if (given) {
                sink = [&views](size_t i, uint64_t size) -> uint8_t* {
                    if (size > views[i].size_bytes())
                        throw tc::StatusError("InvalidArgument",
                                              "a " + std::to_string(size) +
                                                  "-byte page does not fit its " +
                                                  std::to_string(views[i].size_bytes()) +
                                                  "-byte buffer");
                    return views[i].data();
                };
            } else {
                // Python objects need the GIL: taken briefly per page, uninitialized memory.
                sink = [&made](size_t i, uint64_t size) -> uint8_t* {
                    nb::gil_scoped_acquire gil;
                    PyObject* array = PyByteArray_FromStringAndSize(nullptr, Py_ssize_t(size));
                    if (array == nullptr) {
                        PyErr_Clear();
                        throw tc::StatusError("ResourceExhausted",
                                              "no memory for a page of " + std::to_string(size) +
                                                  " bytes");
                    }
                    made[i] = nb::steal(array);
                    return reinterpret_cast<uint8_t*>(PyByteArray_AS_STRING(array));
                };
            }
            tc::RemoteGetResult result;
            {
                nb::gil_scoped_release release;
                result = tc::remote_get(native, targets, sink, options);
            }
            nb::list pages;
            for (size_t i = 0; i < native.size(); ++i) {
                const auto& page = result.pages[i];
                if (!page) {
                    pages.append(nb::none());
                    continue;
                }
                nb::list shape;
                for (int64_t d : page->shape) shape.append(d);
                pages.append(nb::make_tuple(page->size_bytes, page->dtype, nb::tuple(shape),
                                            page->hash, given ? nb::none() : made[i]));
            }
            return nb::make_tuple(pages, home_errors(result.errors));
        },
        nb::arg("keys"), nb::arg("homes"), nb::arg("into").none(), nb::arg("token"),
        nb::arg("tls"), nb::arg("timeout_ms"), nb::arg("streams") = 0,
        "Read pages (key, shard, token) from remote homes [(host, port, [key indexes])], every "
        "home in parallel, hash-checked as they land in `into`'s buffers (or new bytearrays). "
        "Returns (per key: (size_bytes, dtype, shape, hash, bytearray or None) or None; per "
        "home: None or (error kind, message)).");

    m.def(
        "remote_exists",
        [](const std::vector<std::tuple<std::string, uint32_t, uint64_t>>& keys,
           const std::vector<PyHome>& homes, const std::string& token,
           const std::vector<std::string>& tls, uint32_t timeout_ms) {
            const auto native = page_keys(keys);
            const auto targets = remote_homes(homes);
            const auto options = remote_options(token, tls, timeout_ms, 0);
            tc::RemoteExistsResult result;
            {
                nb::gil_scoped_release release;
                result = tc::remote_exists(native, targets, options);
            }
            nb::list found;
            for (bool f : result.found) found.append(f);
            return nb::make_tuple(found, home_errors(result.errors));
        },
        nb::arg("keys"), nb::arg("homes"), nb::arg("token"), nb::arg("tls"),
        nb::arg("timeout_ms"));

    m.def(
        "remote_put",
        [](nb::sequence pages, nb::sequence sources, std::vector<std::string> hashes,
           const std::vector<PyHome>& homes, double ttl_s, bool if_absent,
           const std::string& token, const std::vector<std::string>& tls, uint32_t timeout_ms,
           uint32_t streams, double expires_in_s) {
            using Meta =
                std::tuple<std::string, uint32_t, uint64_t, std::string, std::vector<int64_t>>;
            const size_t count = nb::len(pages);
            if (nb::len(sources) != count || (!hashes.empty() && hashes.size() != count))
                throw nb::value_error("remote_put: pages, sources and hashes differ in length");
            std::vector<BufferView> views;
            views.reserve(count);
            std::vector<tc::RemotePagePut> puts(count);
            for (size_t i = 0; i < count; ++i) {
                tc::RemotePagePut& p = puts[i];
                std::tie(p.key, p.shard, p.token, p.dtype, p.shape) = nb::cast<Meta>(pages[i]);
                views.emplace_back(sources[i], "each source", false);
                p.data = views.back().data();
                p.size_bytes = views.back().size_bytes();
                if (!hashes.empty()) p.hash = hashes[i];
            }
            const auto targets = remote_homes(homes);
            const auto options = remote_options(token, tls, timeout_ms, streams);
            tc::RemotePutResult result;
            {
                nb::gil_scoped_release release;
                result = tc::remote_put(puts, targets, ttl_s, if_absent, options, expires_in_s);
            }
            return nb::make_tuple(result.hashes, home_errors(result.errors));
        },
        nb::arg("pages"), nb::arg("sources"), nb::arg("hashes"), nb::arg("homes"),
        nb::arg("ttl_s"), nb::arg("if_absent"), nb::arg("token"), nb::arg("tls"),
        nb::arg("timeout_ms"), nb::arg("streams") = 0, nb::arg("expires_in_s") = 0.0,
        "Store pages (key, shard, token, dtype, shape) whose bytes are `sources` at remote homes "
        "[(host, port, [page indexes])], every home in parallel. `hashes` (or []: computed "
        "here) are checked by the homes. Returns (hashes, per home: None or (kind, message)).");

    nb::class_<tc::ArenaAllocator>(m, "ArenaAllocator",
                                   "First-fit, page-aligned allocator over a fixed arena (pure "
                                   "bookkeeping); thread-safe, shared by the pool and its pages.")
        .def(nb::init<uint64_t>(), nb::arg("capacity_bytes"))
        .def("allocate", &tc::ArenaAllocator::allocate, nb::arg("size_bytes"))
        .def("free", &tc::ArenaAllocator::free, nb::arg("offset"))
        .def("size_of", &tc::ArenaAllocator::size_of, nb::arg("offset"))
        .def("largest_free_bytes", &tc::ArenaAllocator::largest_free_bytes)
        .def("free_blocks", &tc::ArenaAllocator::free_blocks)
        .def_prop_ro("capacity_bytes", &tc::ArenaAllocator::capacity_bytes)
        .def_prop_ro("used_bytes", &tc::ArenaAllocator::used_bytes);

    nb::class_<PyPageIndex>(m, "PageIndex", "A worker's KV page index (see page_index.h).")
        .def(nb::init<nb::handle, std::shared_ptr<tc::ArenaAllocator>,
                      std::map<std::string, uint64_t>>(),
             nb::arg("base"), nb::arg("arena"), nb::arg("itemsizes"))
        .def(
            "allocate",
            [](PyPageIndex& p, const std::vector<uint64_t>& sizes, bool evict) {
                nb::gil_scoped_release release;
                return p.index().allocate(sizes, evict);
            },
            nb::arg("sizes"), nb::arg("evict") = true)
        .def(
            "free",
            [](PyPageIndex& p, const std::vector<uint64_t>& offsets) {
                nb::gil_scoped_release release;
                p.index().free(offsets);
            },
            nb::arg("offsets"))
        .def(
            "commit",
            [](PyPageIndex& p, const std::vector<PyPageWrite>& writes, double ttl_s, bool home,
               bool if_absent, bool check_hashes) {
                const auto native = page_writes(writes);
                tc::CommitOptions options;
                options.home = home;
                options.if_absent = if_absent;
                options.check_hashes = check_hashes;
                nb::gil_scoped_release release;
                p.index().commit(native, ttl_s, options);
            },
            nb::arg("writes"), nb::arg("ttl_s"), nb::arg("home"), nb::arg("if_absent") = false,
            nb::arg("check_hashes") = true,
            "check_hashes=False only for regions whose bytes this process hashed as it wrote "
            "them (fetch_remote).")
        .def(
            "fetch_remote",
            [](PyPageIndex& p, const std::vector<std::tuple<std::string, uint32_t, uint64_t>>& keys,
               const std::vector<PyHome>& homes, const std::string& token,
               const std::vector<std::string>& tls, uint32_t timeout_ms, uint32_t streams) {
                const auto native = page_keys(keys);
                const auto targets = remote_homes(homes);
                const auto options = remote_options(token, tls, timeout_ms, streams);
                tc::PageIndex& index = p.index();
                uint8_t* const base = index.base();
                constexpr uint64_t kNone = ~0ull;
                std::vector<uint64_t> offsets(native.size(), kNone), sizes(native.size(), 0);
                std::mutex mutex;  // parts allocate concurrently
                tc::RemoteGetResult result;
                {
                    nb::gil_scoped_release release;
                    // Straight into regions of this pool; a retried page reuses its region.
                    const tc::PageSink sink = [&](size_t i, uint64_t size) -> uint8_t* {
                        std::lock_guard<std::mutex> lock(mutex);
                        if (offsets[i] != kNone && sizes[i] != size) {
                            index.free({offsets[i]});
                            offsets[i] = kNone;
                        }
                        if (offsets[i] == kNone) {
                            offsets[i] = index.allocate({size}, true)[0];
                            sizes[i] = size;
                        }
                        return base + offsets[i];
                    };
                    result = tc::remote_get(native, targets, sink, options);
                    std::vector<uint64_t> unused;
                    for (size_t i = 0; i < native.size(); ++i) {
                        if (offsets[i] == kNone) continue;
                        if (result.pages[i])
                            result.pages[i]->offset = offsets[i];
                        else
                            unused.push_back(offsets[i]);
                    }
                    index.free(unused);
                }
                nb::list found;
                for (const auto& page : result.pages) found.append(page_info_to_py(page));
                return nb::make_tuple(found, home_errors(result.errors));
            },
            nb::arg("keys"), nb::arg("homes"), nb::arg("token"), nb::arg("tls"),
            nb::arg("timeout_ms"), nb::arg("streams") = 0,
            "Read pages (key, shard, token) from remote homes [(host, port, [key indexes])] "
            "straight into regions of this pool, each hash-checked as it lands. Returns (per key: "
            "(offset, size_bytes, dtype, shape, hash) of an uncommitted region, or None; per "
            "home: None or (error kind, message)). Commit the regions (check_hashes=False) or "
            "free them.")
        .def(
            "lookup",
            [](PyPageIndex& p, const std::vector<std::tuple<std::string, uint32_t, uint64_t>>& keys,
               bool read) {
                const auto native = page_keys(keys);
                std::vector<std::optional<tc::Page>> found;
                {
                    nb::gil_scoped_release release;
                    found = p.index().lookup(native, read);
                }
                std::vector<std::optional<PyPage>> out;
                out.reserve(found.size());
                for (const auto& page : found)
                    out.push_back(page ? std::optional<PyPage>(to_py(*page)) : std::nullopt);
                return out;
            },
            nb::arg("keys"), nb::arg("read") = false,
            "read=True: the caller reads the pages found, which renews their leases.")
        .def(
            "home_pages",
            [](PyPageIndex& p, uint32_t shard, uint64_t max_token) {
                std::vector<tc::Page> pages;
                {
                    nb::gil_scoped_release release;
                    pages = p.index().home_pages(shard, max_token);
                }
                std::vector<PyPage> out;
                for (const auto& page : pages) out.push_back(to_py(page));
                return out;
            },
            nb::arg("shard"), nb::arg("max_token"))
        .def(
            "drop_shards",
            [](PyPageIndex& p, const std::set<uint32_t>& shards, std::optional<uint64_t> max_token) {
                nb::gil_scoped_release release;
                return p.index().drop_shards(shards, max_token);
            },
            nb::arg("shards"), nb::arg("max_token").none() = nb::none())
        .def("expire",
             [](PyPageIndex& p) {
                 nb::gil_scoped_release release;
                 return p.index().expire();
             })
        .def("stats",
             [](PyPageIndex& p) {
                 tc::PageIndexStats s;
                 {
                     nb::gil_scoped_release release;
                     s = p.index().stats();
                 }
                 nb::dict d;
                 d["pages"] = s.pages;
                 d["home_pages"] = s.home_pages;
                 d["bytes"] = s.bytes;
                 d["region_bytes"] = s.region_bytes;
                 return d;
             })
        .def(
            "set_leases",
            [](PyPageIndex& p, const std::map<uint32_t, std::pair<uint64_t, double>>& held) {
                nb::gil_scoped_release release;
                p.index().set_leases(held);
            },
            nb::arg("held"), "shard -> (token, monotonic deadline) of the leases held now.")
        .def("set_lease_fallback", &PyPageIndex::set_lease_fallback, nb::arg("fn"))
        .def(
            "attach_directory",
            [](PyPageIndex& p, std::shared_ptr<tc::PageDirectory> directory) {
                p.index().attach_directory(std::move(directory));
            },
            nb::arg("directory"), "Mirror the index into a PageDirectory for same-host readers.")
        .def("close", &PyPageIndex::close,
             "Drop the fallback and release the pool buffer (stop page servers first).");

    nb::class_<tc::PageDirectory>(m, "PageDirectory",
                                  "The worker's shared-memory mirror of its page index "
                                  "(see page_directory.h).")
        .def(nb::init<uint32_t>(), nb::arg("min_slots"))
        .def_prop_ro("fd", &tc::PageDirectory::fd)
        .def_prop_ro("size_bytes", &tc::PageDirectory::size_bytes)
        .def_prop_ro("slots", &tc::PageDirectory::slots);

    nb::class_<tc::DirectoryReader>(m, "DirectoryReader",
                                    "A caller's read-only view of a worker's page directory.")
        .def(nb::init<int, uint64_t>(), nb::arg("fd"), nb::arg("size_bytes"))
        .def(
            "lookup",
            [](const tc::DirectoryReader& r,
               const std::vector<std::tuple<std::string, uint32_t, uint64_t>>& keys, bool read) {
                nb::list out;
                for (const auto& [key, shard, token] : keys)
                    out.append(found_to_py(r.lookup(key, shard, token, read)));
                return out;
            },
            nb::arg("keys"), nb::arg("read"),
            "Per (key, shard, token): (offset, size_bytes, dtype, shape, hash) of a live page, "
            "or None (then ask the worker). read=True when the caller copies the pages: that "
            "renews their leases (an exists does not).");

    nb::class_<tc::PageClient>(m, "PageClient",
                               "A caller's end of a worker's page socket (see page_client.h). "
                               "Thread-safe; the GIL is released while it talks to the worker.")
        .def(nb::init<int, int>(), nb::arg("fd"), nb::arg("timeout_ms"),
             "Takes ownership of `fd`, a connected page socket.")
        .def("hello", &tc::PageClient::hello, nb::arg("token"),
             nb::call_guard<nb::gil_scoped_release>(), "Authenticate; returns the pool's size.")
        .def("alloc", &tc::PageClient::alloc, nb::arg("sizes"),
             nb::call_guard<nb::gil_scoped_release>())
        .def(
            "commit",
            [](tc::PageClient& c, double ttl_s, const std::vector<PyPageWrite>& pages,
               const std::vector<uint64_t>& ahead) {
                const auto writes = page_writes(pages);
                nb::gil_scoped_release release;
                return c.commit(ttl_s, writes, ahead);
            },
            nb::arg("ttl_s"), nb::arg("pages"), nb::arg("ahead"),
            "Index pages (key, shard, token, dtype, shape, offset, size_bytes, hash) written at "
            "their offsets; returns regions reserved for the next put (sizes `ahead`).")
        .def(
            "get",
            [](tc::PageClient& c,
               const std::vector<std::tuple<std::string, uint32_t, uint64_t>>& keys) {
                std::vector<std::optional<tc::PageWrite>> found;
                {
                    const auto native = page_keys(keys);
                    nb::gil_scoped_release release;
                    found = c.get(native);
                }
                nb::list out;
                for (const auto& page : found) out.append(found_to_py(page));
                return out;
            },
            nb::arg("keys"),
            "Per (key, shard, token): (offset, size_bytes, dtype, shape, hash), or None.")
        .def(
            "exists",
            [](tc::PageClient& c,
               const std::vector<std::tuple<std::string, uint32_t, uint64_t>>& keys) {
                const auto native = page_keys(keys);
                nb::gil_scoped_release release;
                return c.exists(native);
            },
            nb::arg("keys"))
        .def(
            "put",
            [](tc::PageClient& c, nb::handle pool, double ttl_s, nb::sequence pages,
               nb::sequence sources) {
                using Meta = std::tuple<std::string, uint32_t, uint64_t, std::string,
                                        std::vector<int64_t>>;
                const size_t count = nb::len(pages);
                if (nb::len(sources) != count)
                    throw nb::value_error("put: pages and sources differ in length");
                const BufferView pool_view(pool, "pool", true);
                std::vector<BufferView> views;
                std::vector<tc::PagePut> puts(count);
                views.reserve(count);
                for (size_t i = 0; i < count; ++i) {
                    tc::PagePut& p = puts[i];
                    std::tie(p.key, p.shard, p.token, p.dtype, p.shape) =
                        nb::cast<Meta>(pages[i]);
                    views.emplace_back(sources[i], "each source", false);
                    p.data = views.back().data();
                    p.size_bytes = views.back().size_bytes();
                }
                nb::gil_scoped_release release;
                return c.put(pool_view.data(), pool_view.size_bytes(), ttl_s, puts);
            },
            nb::arg("pool"), nb::arg("ttl_s"), nb::arg("pages"), nb::arg("sources"),
            "Copy each source into the pool (hashing it as it goes) and commit the pages "
            "(key, shard, token, dtype, shape); returns their hashes.")
        .def("hung_up", &tc::PageClient::hung_up, nb::call_guard<nb::gil_scoped_release>(),
             "True when the worker closed its end (then the client is broken).")
        .def_prop_ro("broken", &tc::PageClient::broken)
        .def_prop_ro("fileno", &tc::PageClient::fd)
        .def("spare", &tc::PageClient::spare, "Regions reserved for the next puts: size -> offsets.")
        .def("requests_sent", &tc::PageClient::requests_sent, nb::arg("op"))
        .def("close", &tc::PageClient::close, nb::call_guard<nb::gil_scoped_release>());

    nb::class_<tc::PageServer>(m, "PageServer",
                               "Serves same-host page requests natively (see page_server.h).")
        .def(
            "__init__",
            [](tc::PageServer* self, const std::string& address, PyPageIndex& index,
               const std::string& token, uint64_t arena_bytes) {
                new (self) tc::PageServer(address, index.shared(), token, arena_bytes);
            },
            nb::arg("address"), nb::arg("index"), nb::arg("token"), nb::arg("arena_bytes"))
        .def("stats",
             [](tc::PageServer& s) {
                 const tc::PageServerStats st = s.stats();
                 nb::dict d;
                 d["requests"] = st.requests;
                 d["errors_sent"] = st.errors_sent;
                 d["active_connections"] = st.active_connections;
                 d["connections_accepted"] = st.connections_accepted;
                 d["uncommitted_bytes"] = st.uncommitted_bytes;
                 return d;
             })
        .def(
            "stop",
            [](tc::PageServer& s) {
                nb::gil_scoped_release release;
                s.stop();
            },
            "Close the socket and every connection (their regions are freed); idempotent.");
}
