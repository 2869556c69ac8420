"""Container health: is the coordinator's gRPC health service SERVING? Exit 0 if so, 1 if not.

Cheaper than `fedsaddle health` (it imports grpc and the health stubs only).
    python3 healthcheck.py 127.0.0.1:50051
"""

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

address = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"
try:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=4)
except grpc.RpcError as exc:
    print(f"{address}: {exc.code().name}", file=sys.stderr)
    sys.exit(1)
sys.exit(0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1)
