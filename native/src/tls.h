// TLS for the data plane (OpenSSL): contexts from PEM files, a bounded handshake on a
// non-blocking socket, and the send/receive steps net.cpp routes to when a connection has a
// session (IoLimits::ssl). Mutual: servers require a client certificate from the same CA.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <string>

#include "net.h"
#include "tensorcast/transport.h"

struct ssl_ctx_st;

namespace tc::tls {

struct ContextFree {
    void operator()(ssl_ctx_st* ctx) const;
};
struct SessionFree {
    void operator()(ssl_st* ssl) const;
};
using Context = std::unique_ptr<ssl_ctx_st, ContextFree>;
using Session = std::unique_ptr<ssl_st, SessionFree>;

// A context for one side. Throws std::invalid_argument naming the file or OpenSSL's reason.
Context make_context(const TlsFiles& files, bool server);

// The process's client context for these files (made once: loading them costs milliseconds).
ssl_ctx_st* client_context(const TlsFiles& files);

// Runs the handshake on a connected non-blocking socket within `limits`. Returns "" and sets
// *session on success, else a message saying why (verification failure, timeout, ...).
// `peer_host` (client side): the name or address the peer's certificate must carry.
std::string handshake(int fd, ssl_ctx_st* ctx, bool server, const std::string& peer_host,
                      const net::IoLimits& limits, Session* session);

net::Io send_all(ssl_st* ssl, int fd, iovec* iov, int iov_count, const net::IoLimits& limits,
                 int* error);
net::Io recv_step(ssl_st* ssl, int fd, uint8_t* dest, uint64_t size_bytes,
                  const net::IoLimits& limits, net::Clock::time_point* last_progress,
                  uint64_t* received, int* error);

}  // namespace tc::tls
