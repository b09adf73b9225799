#include "tls.h"

#include <arpa/inet.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>

namespace tc::tls {
namespace {

std::string openssl_errors() {
    std::string out;
    while (const unsigned long code = ERR_get_error()) {
        char text[256];
        ERR_error_string_n(code, text, sizeof text);
        out += (out.empty() ? "" : "; ") + std::string(text);
    }
    return out.empty() ? "unknown OpenSSL error" : out;
}

bool is_ip(const std::string& host) {
    in6_addr address6;
    in_addr address4;
    return inet_pton(AF_INET, host.c_str(), &address4) == 1 ||
           inet_pton(AF_INET6, host.c_str(), &address6) == 1;
}

// What an OpenSSL call that returned `result` asks for: wait for a direction, or an outcome.
net::Io want(ssl_st* ssl, int result, int fd, const net::IoLimits& limits,
             net::Clock::time_point last_progress, int* error, bool* retry) {
    *retry = false;
    switch (SSL_get_error(ssl, result)) {
        case SSL_ERROR_WANT_READ: {
            const net::Io io = net::wait_ready(fd, POLLIN, limits, last_progress);
            *retry = io == net::Io::kOk;
            return io;
        }
        case SSL_ERROR_WANT_WRITE: {
            const net::Io io = net::wait_ready(fd, POLLOUT, limits, last_progress);
            *retry = io == net::Io::kOk;
            return io;
        }
        case SSL_ERROR_ZERO_RETURN: return net::Io::kClosed;
        case SSL_ERROR_SYSCALL:
            if (errno == EINTR) {
                *retry = true;
                return net::Io::kOk;
            }
            if (errno == 0 || errno == EPIPE || errno == ECONNRESET) return net::Io::kClosed;
            if (error != nullptr) *error = errno;
            return net::Io::kError;
        default:
            ERR_clear_error();
            if (error != nullptr) *error = EPROTO;
            return net::Io::kError;
    }
}

}  // namespace

void ContextFree::operator()(ssl_ctx_st* ctx) const { SSL_CTX_free(ctx); }
void SessionFree::operator()(ssl_st* ssl) const { SSL_free(ssl); }

Context make_context(const TlsFiles& files, bool server) {
    Context ctx(SSL_CTX_new(server ? TLS_server_method() : TLS_client_method()));
    if (!ctx) throw std::invalid_argument("TLS: " + openssl_errors());
    SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
    // Writes may return having sent part of a buffer, and be retried from a moved pointer.
    SSL_CTX_set_mode(ctx.get(), SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    if (server) SSL_CTX_set_num_tickets(ctx.get(), 0);  // nothing unread left on pooled links
    if (SSL_CTX_use_certificate_chain_file(ctx.get(), files.cert.c_str()) != 1)
        throw std::invalid_argument("TLS certificate " + files.cert + ": " + openssl_errors());
    if (SSL_CTX_use_PrivateKey_file(ctx.get(), files.key.c_str(), SSL_FILETYPE_PEM) != 1 ||
        SSL_CTX_check_private_key(ctx.get()) != 1)
        throw std::invalid_argument("TLS key " + files.key + ": " + openssl_errors());
    if (SSL_CTX_load_verify_locations(ctx.get(), files.ca.c_str(), nullptr) != 1)
        throw std::invalid_argument("TLS CA " + files.ca + ": " + openssl_errors());
    SSL_CTX_set_verify(ctx.get(),
                       SSL_VERIFY_PEER | (server ? SSL_VERIFY_FAIL_IF_NO_PEER_CERT : 0), nullptr);
    return ctx;
}

ssl_ctx_st* client_context(const TlsFiles& files) {
    static std::mutex mutex;
    static auto* contexts = new std::map<std::tuple<std::string, std::string, std::string>,
                                         Context>();  // never destroyed: safe at exit
    std::lock_guard<std::mutex> lock(mutex);
    auto& slot = (*contexts)[{files.ca, files.cert, files.key}];
    if (!slot) slot = make_context(files, false);
    return slot.get();
}

std::string handshake(int fd, ssl_ctx_st* ctx, bool server, const std::string& peer_host,
                      const net::IoLimits& limits, Session* session) {
    Session ssl(SSL_new(ctx));
    if (!ssl || SSL_set_fd(ssl.get(), fd) != 1) return "TLS setup: " + openssl_errors();
    if (!server && !peer_host.empty()) {
        X509_VERIFY_PARAM* param = SSL_get0_param(ssl.get());
        const int ok = is_ip(peer_host) ? X509_VERIFY_PARAM_set1_ip_asc(param, peer_host.c_str())
                                        : SSL_set1_host(ssl.get(), peer_host.c_str());
        if (ok != 1) return "TLS setup for " + peer_host + ": " + openssl_errors();
    }
    const auto started = net::Clock::now();
    for (;;) {
        const int result = server ? SSL_accept(ssl.get()) : SSL_connect(ssl.get());
        if (result == 1) {
            *session = std::move(ssl);
            return "";
        }
        const long verify = SSL_get_verify_result(ssl.get());
        const int code = SSL_get_error(ssl.get(), result);
        if (code != SSL_ERROR_WANT_READ && code != SSL_ERROR_WANT_WRITE) {
            std::string reason = openssl_errors();
            if (verify != X509_V_OK)
                reason = "certificate verification failed: " +
                         std::string(X509_verify_cert_error_string(verify));
            else if (code == SSL_ERROR_SYSCALL || code == SSL_ERROR_ZERO_RETURN)
                reason = "the peer closed the connection during the handshake";
            return "TLS handshake failed: " + reason;
        }
        int error = 0;
        bool retry = false;
        const net::Io io = want(ssl.get(), result, fd, limits, started, &error, &retry);
        if (!retry)
            return std::string("TLS handshake ") +
                   (io == net::Io::kTimeout ? "timed out" : net::io_name(io));
    }
}

net::Io send_all(ssl_st* ssl, int fd, iovec* iov, int iov_count, const net::IoLimits& limits,
                 int* error) {
    auto last_progress = net::Clock::now();
    for (int i = 0; i < iov_count; ++i) {
        auto* data = static_cast<const uint8_t*>(iov[i].iov_base);
        size_t left = iov[i].iov_len;
        while (left > 0) {
            const int n = SSL_write(ssl, data, int(std::min<size_t>(left, INT_MAX)));
            if (n > 0) {
                data += n;
                left -= size_t(n);
                last_progress = net::Clock::now();
                continue;
            }
            bool retry = false;
            const net::Io io = want(ssl, n, fd, limits, last_progress, error, &retry);
            if (!retry) return io;
        }
    }
    return net::Io::kOk;
}

net::Io recv_step(ssl_st* ssl, int fd, uint8_t* dest, uint64_t size_bytes,
                  const net::IoLimits& limits, net::Clock::time_point* last_progress,
                  uint64_t* received, int* error) {
    *received = 0;
    if (limits.max_piece_bytes > 0) size_bytes = std::min(size_bytes, limits.max_piece_bytes);
    for (;;) {
        const int n = SSL_read(ssl, dest, int(std::min<uint64_t>(size_bytes, INT_MAX)));
        if (n > 0) {
            *received = uint64_t(n);
            *last_progress = net::Clock::now();
            return net::Io::kOk;
        }
        bool retry = false;
        const net::Io io = want(ssl, n, fd, limits, *last_progress, error, &retry);
        if (!retry) return io;
    }
}

}  // namespace tc::tls
