"""Regenerate the committed Python stubs of proto/ into router/api/.

Run ``python -m router.api.generate_stubs`` from a checkout after editing a .proto file.
protoc sees the proto tree through the virtual include path ``router/api=proto``: each
file's name becomes ``router/api/pdserve/v1/<name>.proto``, so the generated modules land
in this package and their cross-module imports read ``from router.api.pdserve.v1 import ...``,
which resolves without editing generated code.
"""

from __future__ import annotations

import argparse
import importlib.resources
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"
# Where the proto tree appears to protoc, and therefore the generated package's path.
PACKAGE_PREFIX = "router/api"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Every .proto source under proto_root, in a stable order."""
    return sorted(proto_root.rglob("*.proto"))


def generate(out_root: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Compile every .proto under proto_root into out_root/router/api/...; return the files written."""
    from grpc_tools import protoc  # a test/dev dependency only: the server imports the stubs, not this

    sources = proto_files(proto_root)
    if not sources:
        raise FileNotFoundError(f"no .proto files under {proto_root}")
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PACKAGE_PREFIX}={proto_root}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(path) for path in sources),
    ]
    status = protoc.main(args)
    if status != 0:
        raise RuntimeError(f"protoc failed with status {status} (args: {' '.join(args[1:])})")
    written = generated_files(out_root / PACKAGE_PREFIX)
    logger.info("generated %d files under %s", len(written), out_root / PACKAGE_PREFIX)
    return written


def generated_files(package_dir: Path) -> list[Path]:
    """The protoc outputs below package_dir (hand-written __init__.py files excluded)."""
    return sorted(p for p in package_dir.rglob("*") if p.is_file() and p.name.endswith(GENERATED_SUFFIXES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT, help="root to write router/api/... under (default: this checkout)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for path in generate(args.out):
        logger.info("  %s", path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
