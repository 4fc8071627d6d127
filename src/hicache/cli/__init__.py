"""The `hicache` command line: plan, bench, demo, shm, config.

Each command lives in its own module and registers a subparser through ``register(subparsers)``;
its handler returns the exit status. Bad input (a HiCacheError) exits 2 with one line on stderr,
a runtime failure exits 1 with one line; neither prints a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hicache.domain import HiCacheError

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One line, exit 2, as for every other bad input.
        sys.stderr.write(f"hicache: error: {message}\n")
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    from hicache.cli import bench, config, demo, plan, shm

    parser = _Parser(prog="hicache", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in (plan, bench, demo, shm, config):
        module.register(sub)
    return parser


def _version() -> str:
    from hicache import __version__

    return f"hicache {__version__}"


def _one_line(e: BaseException) -> str:
    """An error's message on one line: what the one-line promise of the command line needs."""
    return " ".join(part.strip() for part in str(e).splitlines() if part.strip())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status: int = args.handler(args)
    except HiCacheError as e:
        sys.stderr.write(f"hicache: error: {_one_line(e)}\n")
        return EXIT_USAGE if isinstance(e, ValueError) else EXIT_RUNTIME
    except KeyboardInterrupt:
        sys.stderr.write("hicache: interrupted\n")
        return 130
    except OSError as e:
        sys.stderr.write(f"hicache: error: {_one_line(e)}\n")
        return EXIT_RUNTIME
    return status
