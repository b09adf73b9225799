// Exception hierarchy of the native core; bindings.cpp maps each to a Python class.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

namespace tc {

struct NativeError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// The file ends before the requested range does.
struct ShortFileError : NativeError {
    using NativeError::NativeError;
};

// An OS call failed (open/pread, or socket/bind/listen for the data server);
// the message carries the path or address and strerror.
struct IoError : NativeError {
    using NativeError::NativeError;
};

// A refusal the caller must see as a typed TensorCast error: `kind` is the class name in
// tensorcast.errors ("InvalidArgument", "ResourceExhausted", "IntegrityError", ...).
struct StatusError : NativeError {
    StatusError(std::string kind, const std::string& message)
        : NativeError(message), kind(std::move(kind)) {}
    std::string kind;
};

// Why a data-plane transfer failed; stable names for callers to branch on.
enum class TransferFailure {
    kRefused,                   // could not connect (refused, unreachable, server busy)
    kBadToken,                  // server rejected our HELLO token
    kTicketRejected,            // unknown/expired ticket or range outside the ticket
    kChecksumRetriesExhausted,  // a chunk failed its checksum too many times
    kPeerClosed,                // connections kept dying, reconnects exhausted
    kProtocol,                  // peer sent a malformed or unexpected frame
    kTimeout,
    kCancelled,
    kTls,                       // TLS handshake failed (certificate, CA, or one side plaintext)
};

const char* transfer_failure_name(TransferFailure failure);

struct TransferError : NativeError {
    TransferError(TransferFailure failure, const std::string& message)
        : NativeError(std::string(transfer_failure_name(failure)) + ": " + message),
          failure_(failure) {}
    TransferFailure failure() const { return failure_; }
    const char* reason() const { return transfer_failure_name(failure_); }

private:
    TransferFailure failure_;
};

struct TransferTimeout : TransferError {
    explicit TransferTimeout(const std::string& message)
        : TransferError(TransferFailure::kTimeout, message) {}
};

struct TransferCancelled : TransferError {
    explicit TransferCancelled(const std::string& message)
        : TransferError(TransferFailure::kCancelled, message) {}
};

}  // namespace tc
