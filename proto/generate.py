"""Regenerate the protobuf and gRPC modules from fedsaddle.proto.

The generated modules are committed (so installing needs no code generation) and
`tests/test_wire.py` checks that they match the proto. Run `make proto` after
editing the proto.

protoc names imports after the path a proto has below its include root, so the
proto is staged as `fedsaddle/proto/fedsaddle.proto`: the generated gRPC module
then imports `fedsaddle.proto.fedsaddle_pb2`, the installed name.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GENERATED = ("fedsaddle_pb2.py", "fedsaddle_pb2.pyi", "fedsaddle_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Write the generated modules into out_dir."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "fedsaddle" / "proto"
        staged.mkdir(parents=True)
        shutil.copy(HERE / "fedsaddle.proto", staged / "fedsaddle.proto")
        code = protoc.main(
            [
                "protoc",
                f"-I{tmp}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                str(staged / "fedsaddle.proto"),
            ]
        )
        if code != 0:
            raise SystemExit(f"protoc failed with exit code {code}")
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in GENERATED:
            shutil.copy(staged / name, out_dir / name)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
