"""fedsaddle: federated minimax (saddle-point) optimization over gRPC."""

__version__ = "0.1.0"
