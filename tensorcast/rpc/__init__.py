"""gRPC plumbing shared by the Global Store, workers and clients: channels, auth, error mapping.

Callers import grpc only once a call needs it (clients of a local cluster speak to the store's
frame port and the worker's socket; importing grpc costs ~0.1-0.2 s of every `tc` command)."""

TOKEN_METADATA_KEY = "x-tensorcast-token"

# Marks statuses raised on purpose by a TensorCast service, as opposed to transport failures
# (connection refused, reset) that gRPC reports with the same codes.
ERROR_MARK = "tensorcast: "
