"""The engine options the command lines (chat.py, serve.py, bench.py) parse, read back as
the keywords they would give the engine: one click command wearing `engine_options`."""

from __future__ import annotations

import click
from click.testing import CliRunner

from nanoqwen.cli import engine_options, pop_engine_options


def parse_engine_options(args: list[str]) -> tuple[int, dict[str, object]]:
    """click's exit code for these flags (2: a usage error) and the engine keywords they
    give (empty when refused)."""
    seen: dict[str, object] = {}

    @click.command()
    @engine_options
    def command(**options: object) -> None:
        seen.update(pop_engine_options(options))

    result = CliRunner().invoke(command, args)
    return result.exit_code, seen
