#include "tensorcast/errors.h"

namespace tc {

const char* transfer_failure_name(TransferFailure failure) {
    switch (failure) {
        case TransferFailure::kRefused: return "refused";
        case TransferFailure::kBadToken: return "bad_token";
        case TransferFailure::kTicketRejected: return "ticket_rejected";
        case TransferFailure::kChecksumRetriesExhausted: return "checksum_retries_exhausted";
        case TransferFailure::kPeerClosed: return "peer_closed";
        case TransferFailure::kProtocol: return "protocol";
        case TransferFailure::kTimeout: return "timeout";
        case TransferFailure::kCancelled: return "cancelled";
        case TransferFailure::kTls: return "tls";
    }
    return "unknown";
}

}  // namespace tc
