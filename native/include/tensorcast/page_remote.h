// KV pages for callers on other hosts, over the worker's data port (TCP, mutual TLS when the
// cluster has TLS files). The data server hands a connection whose first byte is the page
// protocol's version (a data-plane frame starts with "TCDP", a TLS record with 22) to the
// worker's RemotePageService; the frames are the same-host page socket's (page_wire.h, one
// codec), with two operations that carry page bytes after the body:
//
//   READ 7: as GET (u32 n, n x (str key, u32 shard, u64 token))
//           -> u32 n, n x (u8 found [, u64 size, str dtype, shape, str hash]), then the found
//              pages' bytes back to back (not counted in the header's body size); renews
//              the lease of each page found, as a GET does
//   PUT  8: f64 ttl_s, u8 flags (1: if absent, 2: an f64 first lease follows, at most ttl_s:
//           a copied page keeps its expiry and renews for ttl_s), u32 n, n x (str key, u32 shard, u64 token,
//           str dtype, shape, u64 size, str hash), then the pages' bytes back to back
//           -> empty body
// plus HELLO (token; -> u64 pool bytes) and EXISTS, as on the page socket. ALLOC, COMMIT and
// GET (which answer with pool offsets) are refused: a remote caller cannot map the pool.
//
// The worker receives a PUT's bytes straight into pool regions it allocated, hashing each piece
// as it lands, and commits only if every page matches the hash its writer claimed (else nothing
// is stored: IntegrityError). A READ's bytes leave straight from the pool; the caller hashes
// each page as it lands in its buffer and treats a mismatch (the page was evicted and its region
// reused while it was sent) as absent, never as other bytes. A request the worker refuses after
// its header (fencing, a full pool) has its bytes drained so the connection stays usable; a
// malformed one is answered and the connection closed.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tensorcast/page_client.h"
#include "tensorcast/page_index.h"
#include "tensorcast/transport.h"

struct ssl_st;

namespace tc {

// Page bytes one PUT request may carry: the caller splits larger batches at
// kRemoteRequestBytes; the worker refuses (and closes) beyond min(this, half its pool).
constexpr uint64_t kMaxRemotePutBytes = 1ull << 30;
constexpr uint64_t kRemoteRequestBytes = 64ull << 20;
constexpr uint32_t kDefaultRemoteStreams = 4;  // connections per home for a large batch
constexpr uint32_t kMaxRemoteParts = 32;      // connections one call uses at most, all homes

struct RemotePageStats {
    uint64_t requests = 0;
    uint64_t errors_sent = 0;
    uint64_t bytes_received = 0;  // page bytes of PUTs
    uint64_t bytes_sent = 0;      // page bytes of READs
    uint64_t active_connections = 0;
};

class RemotePageService {
public:
    RemotePageService(std::shared_ptr<PageIndex> index, std::string token, uint64_t arena_bytes);

    // How a served connection tells its server when it is idle (authenticated, waiting for
    // its next request), so that a full server may close it for a new one (data_server.cpp).
    struct IdleMark {
        std::function<void()> waiting;  // before waiting for the next request
        std::function<bool()> busy;     // after it: false when the server closed it meanwhile
    };

    // Serves one connection of the data port whose first page header (8 bytes) was read
    // already; `ssl` is its TLS session or null. Returns when the peer closes or breaks the
    // protocol, `wake_fd` (the data server stopping) becomes readable, or the server evicts
    // the connection while idle (`idle`, optional).
    void serve(int fd, ssl_st* ssl, const uint8_t* first_header, int wake_fd,
               const IdleMark& idle = {});
    RemotePageStats stats() const;
    // Test hook: the next n pages a READ sends go out with a wrong hash (the bytes are intact),
    // like a page damaged on its way. n = 0 disarms.
    void inject_corrupt_pages(uint32_t n) { corrupt_countdown_ = n; }

    struct Connection;

private:
    void handle(Connection& c, uint8_t op, const std::vector<uint8_t>& body);
    void read(Connection& c, const std::vector<uint8_t>& body);
    void put(Connection& c, const std::vector<uint8_t>& body);

    std::shared_ptr<PageIndex> index_;
    std::string token_;
    uint64_t arena_bytes_;
    std::atomic<uint32_t> corrupt_countdown_{0};
    std::atomic<uint64_t> receiving_{0};  // page bytes of PUTs allocated, not yet committed
    std::atomic<uint64_t> requests_{0}, errors_sent_{0}, bytes_received_{0}, bytes_sent_{0},
        active_{0};
};

// -- the caller's end --------------------------------------------------------------------------

struct RemoteOptions {
    std::string token;
    TlsFiles tls;
    uint32_t timeout_ms = 30000;  // the whole call, every home
    uint32_t streams = 0;         // connections per home for a large batch (0 = default)
};

// One home of a batch: its data port and the batch's pages it holds (indexes into the call's
// keys or pages).
struct RemoteHome {
    std::string host;
    uint16_t port = 0;
    std::vector<size_t> pages;
};

// Why a home's share of a batch failed: a tensorcast.errors class name and a message.
struct HomeError {
    std::string kind;
    std::string message;
};

// Where page `index` (of `size_bytes`) is to be received. May throw StatusError (e.g. a buffer
// too small): that home's share fails with it. May be called again for a page whose first
// receipt failed (a retry on a fresh connection).
using PageSink = std::function<uint8_t*(size_t index, uint64_t size_bytes)>;

struct RemoteGetResult {
    std::vector<std::optional<PageWrite>> pages;   // by key; key/shard/token as asked, offset 0
    std::vector<std::optional<HomeError>> errors;  // by home
};
// Pages by key from their homes, every home (and, for a large batch, several connections per
// home) in parallel, each page received straight into sink's buffer and checked against its
// hash. Homes that fail leave their pages absent and report why in `errors`.
RemoteGetResult remote_get(const std::vector<PageKey>& keys, const std::vector<RemoteHome>& homes,
                           const PageSink& sink, const RemoteOptions& options);

struct RemoteExistsResult {
    std::vector<bool> found;
    std::vector<std::optional<HomeError>> errors;
};
RemoteExistsResult remote_exists(const std::vector<PageKey>& keys,
                                 const std::vector<RemoteHome>& homes,
                                 const RemoteOptions& options);

// A page to store at a remote home. An empty `hash` is computed here from `data`; a given one
// (a worker forwarding a page it holds) is sent as claimed, and the home checks the bytes
// against it.
struct RemotePagePut : PagePut {
    std::string hash;
};

struct RemotePutResult {
    std::vector<std::string> hashes;               // by page (hex), also for failed homes
    std::vector<std::optional<HomeError>> errors;  // by home
};
RemotePutResult remote_put(const std::vector<RemotePagePut>& pages,
                           const std::vector<RemoteHome>& homes, double ttl_s, bool if_absent,
                           const RemoteOptions& options, double expires_in_s = 0);

}  // namespace tc
