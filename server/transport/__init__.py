"""The transports: in-process (local_pool.py: every client's computation in this process), and gRPC (the rest:
the coordinator's server side of every client session)."""
