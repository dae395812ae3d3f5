"""Regenerate streamkit/protocol/*_pb2*.py from the .proto files.

Run from anywhere: `python scripts/gen_protocol.py`. The output is committed;
tests/test_protocol_generated.py fails when it is stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted((ROOT / "streamkit" / "protocol").glob("*.proto"))


def generate(out_dir: Path) -> None:
    """Compile every .proto of streamkit/protocol into out_dir (mirroring paths)."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(ROOT)) for p in PROTOS],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(ROOT)
    print(f"generated code for {len(PROTOS)} proto file(s)", file=sys.stderr)
