"""The gRPC transport: the coordinator's server side of every client session."""
