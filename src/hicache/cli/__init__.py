"""The `hicache` command line: plan, bench, demo, shm, config.

Each command lives in its own module and registers a subparser through ``register(subparsers)``;
its handler returns the exit status. Help: every command has a description, every option with a
fixed set of values lists them ("one of a, b, c", or argparse's {a,b} for ``choices``), and every
default is shown one way, "(default: X)", appended by the help formatter (a help text that
explains its default writes "(default: ...)" itself). Bad input (a HiCacheError) exits 2 with one line on stderr,
a runtime failure exits 1 with one line; neither prints a traceback.
"""

from __future__ import annotations

import argparse
import enum
import sys
from collections.abc import Sequence
from typing import Any

from hicache.cli._logs import QuietLogs
from hicache.domain import HiCacheError

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help when it has a default worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "(default:" in text
            or not action.option_strings
            or action.nargs == 0  # flags: store_true, store_const, version
            or default is None
            or default is argparse.SUPPRESS
            or default == []
        ):
            return text
        shown = default.value if isinstance(default, enum.Enum) else default
        return f"{text} (default: {str(shown).replace('%', '%%')})"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

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
        # Every command is an application: structlog to stderr at warning level for its run, so
        # stdout holds only the command's own output (one JSON document with --json).
        with QuietLogs():
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
