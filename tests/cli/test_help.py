"""Every command's --help: a description, every choice of each option listed, and every default
written one way, "(default: X)"."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from hicache.bootstrap import bundled_models
from hicache.cli import build_parser, main
from hicache.domain import DType, Layout
from hicache.domain.host_memory import KNOWN_BACKENDS
from hicache.domain.stages import PPSplit
from hicache.integrations.vllm.kv_layouts import BLOCK_RUN_LAYOUTS

DEVICES = ("cpu", "cuda[:N]", "rocm[:N]")
# Options whose values come from a fixed set but are parsed by hicache (case, aliases and error
# messages are the domain's), so argparse's ``choices`` is not used: the help must list them.
LISTED = {
    ("plan", "--model"): tuple(bundled_models()),
    ("plan", "--layout"): tuple(m.value for m in Layout),
    ("plan", "--pool-layout"): tuple(m.value for m in Layout),
    ("plan", "--pp-split"): tuple(m.value for m in PPSplit),
    ("plan", "--kv-dtype"): tuple(m.value for m in DType),
    ("plan", "--ssm-dtype"): tuple(m.value for m in DType),
    ("plan", "--storage-backend"): tuple(sorted(KNOWN_BACKENDS)),
    ("bench copy", "--device"): DEVICES,
    ("bench copy", "--layouts"): tuple(m.value for m in Layout),
    ("bench copy", "--backend"): ("auto", "naive", "torch", "memcpy", "cuda_batch"),
    ("bench overlap", "--device"): DEVICES,
    ("bench overlap", "--layout"): tuple(m.value for m in Layout),
    ("bench storage", "--layout"): tuple(m.value for m in Layout),
    ("bench vllm", "--device"): ("cpu", "cuda"),
    ("bench vllm-worker", "--layout"): BLOCK_RUN_LAYOUTS,
    ("demo", "--device"): DEVICES,
    ("demo", "--storage"): ("none", "directory", "mooncake"),
}
# An option named like one of these takes a value from a fixed set: it must have ``choices``
# or be in LISTED, so a new one cannot slip through unlisted.
CHOICE_LIKE = re.compile(
    r"^(\w*layouts?|\w*backend|device|\w*dtype|\w*split|storage|store|model|\w*memory)$"
)


def _commands(
    parser: argparse.ArgumentParser, name: str = ""
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from _commands(child, f"{name} {sub}".strip())


COMMANDS = dict(_commands(build_parser()))


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.help is not argparse.SUPPRESS]


def _flat(text: str) -> str:
    """The help as one line: argparse wraps at spaces and after hyphens ("kimi-" / "linear")."""
    return re.sub(r"-\s+(?=\w)", "-", re.sub(r"\s+", " ", text))


def _option_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    formatter.add_argument(action)
    return _flat(formatter.format_help())


def test_every_command_is_found() -> None:
    assert {"plan", "bench copy", "bench soak", "demo", "shm list", "shm gc", "config"} <= set(
        COMMANDS
    )


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_a_description(command: str) -> None:
    parser = COMMANDS[command]
    assert (parser.description or "").strip(), f"`hicache {command}` has none"
    assert parser.description is not None
    assert parser.description.strip() in _flat(parser.format_help())


def _unlisted(command: str, parser: argparse.ArgumentParser) -> list[str]:
    problems = []
    for action in _options(parser):
        flag = action.option_strings[-1]
        values = LISTED.get((command, flag))
        if action.choices is not None:
            values = tuple(str(c) for c in action.choices)
        elif values is None:
            if CHOICE_LIKE.search(action.dest):
                problems.append(
                    f"`hicache {command} {flag}` looks like a choice option: give it choices= or "
                    f"list its values with hicache.cli._options.one_of and add it to LISTED"
                )
            continue
        shown = _option_help(parser, action)
        missing = [v for v in values if v not in shown]
        if missing:
            problems.append(f"`hicache {command} {flag}` does not list {missing}: {shown}")
    return problems


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_choice_is_listed_in_the_options_help(command: str) -> None:
    assert _unlisted(command, COMMANDS[command]) == []


def test_the_choice_check_catches_an_option_that_omits_a_choice() -> None:
    parser = argparse.ArgumentParser(prog="demo")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")  # rocm left out
    parser.add_argument("--storage-backend", help="storage backend")  # nothing listed
    problems = _unlisted("demo", parser)
    assert any("--device` does not list ['rocm[:N]']" in p for p in problems)
    assert any("--storage-backend` looks like a choice option" in p for p in problems)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_default_is_written_one_way(command: str) -> None:
    parser = COMMANDS[command]
    for action in _options(parser):
        shown = _option_help(parser, action)
        flag = action.option_strings[-1]
        # "default" only ever appears as "(default: ...)" (the measured default is no default).
        for m in re.finditer(r"default", shown):
            before = shown[max(0, m.start() - 1) : m.start()]
            after = shown[m.end() : m.end() + 1]
            assert (before, after) == ("(", ":") or "measured default" in shown, (command, shown)
        default = action.default
        if action.nargs == 0 or default in (None, [], argparse.SUPPRESS):
            continue
        value = getattr(default, "value", default)
        assert "(default:" in shown, f"`hicache {command} {flag}` hides its default {value!r}"
        if f"(default: {value}" not in shown:
            # A help that explains its default itself must still name the value.
            assert str(value) in shown, (command, flag, shown)


def test_the_formatter_shows_a_default_it_was_not_told_about() -> None:
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices["demo"]  # type: ignore[union-attr]
    action = next(a for a in sub._actions if "--turns" in a.option_strings)
    assert "(default: 3)" in _option_help(sub, action)
    action.default = 7
    assert "(default: 7)" in _option_help(sub, action)
    action.default = 3


@pytest.mark.parametrize("command", ["bench", "shm list", "shm gc", "config", "plan"])
def test_help_exits_0_and_prints_the_description(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*command.split(), "--help"])
    assert info.value.code == 0
    assert (COMMANDS[command].description or "").split()[0] in capsys.readouterr().out
