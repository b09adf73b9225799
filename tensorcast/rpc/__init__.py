"""gRPC plumbing shared by the Global Store, workers and clients: channels, auth, error mapping."""
