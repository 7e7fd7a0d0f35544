"""Argument parsing shared by every command: one-line errors and defaults on every help screen."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks (example commands stay one per line) and appends
    each option's default to its help (an option whose default is None says in its help
    what None means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "%(default)" in text
            or action.default in (None, argparse.SUPPRESS)
            or action.nargs == 0  # flags: their help says what they switch
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)".lstrip()


class CLIParser(argparse.ArgumentParser):
    """Bad flags fail at once with one line on stderr and exit code 2."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")
