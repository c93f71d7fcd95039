"""``python -m psflow.serve``: serves a job's exports over HTTP until SIGTERM or Ctrl-C.

    python -m psflow.serve --export_dir exports/ctr --onnx head.onnx \\
        --feature items=items:sum --feature users=users:mean:0 --numeric counts=13 --port 8500

Each ``--feature NAME=TABLE[:MODE[:PADDING_ID]]`` is a request feature (an input of the ONNX
graph named NAME) of the exported table TABLE, pooled by MODE (``sum``, ``mean``, ``max``;
default ``mean``); each ``--numeric NAME=WIDTH`` an input of WIDTH numbers an example. Prints
``serving URL`` once it listens. See :mod:`psflow.serve.server`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from psflow.serve.served import Feature
from psflow.serve.server import ModelServer, ServerConfig


def parse_feature(text: str) -> tuple[str, Feature]:
    """``NAME=TABLE[:MODE[:PADDING_ID]]`` as a feature."""
    name, eq, rest = text.partition("=")
    parts = rest.split(":")
    if not eq or not name or not parts[0] or len(parts) > 3:
        raise argparse.ArgumentTypeError(
            f"--feature {text!r}: expected NAME=TABLE[:MODE[:PADDING_ID]]"
        )
    try:
        padding = int(parts[2]) if len(parts) == 3 else None
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--feature {text!r}: the padding id {parts[2]!r} is not an integer"
        ) from None
    try:
        feature = Feature(table=parts[0], mode=parts[1] if len(parts) > 1 else "mean",
                          padding_idx=padding)  # fmt: skip
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--feature {text!r}: {e}") from None
    return name, feature


def parse_numeric(text: str) -> tuple[str, int]:
    """``NAME=WIDTH`` as a numeric input."""
    name, eq, width = text.partition("=")
    if not eq or not name or not width.isdigit() or int(width) < 1:
        raise argparse.ArgumentTypeError(f"--numeric {text!r}: expected NAME=WIDTH (WIDTH >= 1)")
    return name, int(width)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m psflow.serve", description=__doc__.split("\n")[0])
    p.add_argument("--export_dir", required=True, help="the job's export directory")
    p.add_argument("--onnx", required=True, help="the dense part (psflow.serve.dense)")
    p.add_argument("--feature", action="append", type=parse_feature, required=True,
                   metavar="NAME=TABLE[:MODE[:PADDING_ID]]")  # fmt: skip
    p.add_argument("--numeric", action="append", type=parse_numeric, default=[],
                   metavar="NAME=WIDTH", help="an input of numbers, not ids")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: one the OS chooses")
    p.add_argument("--poll_seconds", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime's per request")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        config = ServerConfig(
            export_dir=args.export_dir,
            onnx_path=args.onnx,
            features=dict(args.feature),
            numeric=dict(args.numeric),
            host=args.host,
            port=args.port,
            poll_seconds=args.poll_seconds,
            intra_op_threads=args.threads,
        )
        server = ModelServer(config).start()
    except (ValueError, OSError) as e:
        print(f"psflow.serve: {e}", file=sys.stderr)
        return 2
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    print(f"serving {server.url}", flush=True)
    while not stopping.wait(1.0):
        pass
    server.stop(10.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
