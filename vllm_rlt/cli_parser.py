"""Argument parsing shared by every command: one-line errors and defaults on every help screen."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks (example commands stay one per line) and appends
    each option's default to its help, a switch's as on or off (an option whose default is
    None says in its help what None means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "%(default)" in text
            or "(default:" in text
            or action.default in (None, argparse.SUPPRESS)
            or not action.option_strings
        ):
            return text
        if action.nargs == 0:  # a switch (store_true, --x/--no-x)
            if not isinstance(action.default, bool):
                return text
            return f"{text} (default: {'on' if action.default else 'off'})".lstrip()
        return f"{text} (default: %(default)s)".lstrip()


class CLIParser(argparse.ArgumentParser):
    """Bad flags fail at once with one line on stderr and exit code 2, named by the
    subcommand that was given them and with the closest known flag suggested."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self.subcommand_parser(namespace)
            parser.error(f"unrecognized arguments: {' '.join(extras)}{parser.suggest(extras)}")
        return namespace

    def subcommand_parser(self, namespace: argparse.Namespace) -> CLIParser:
        """The innermost (sub)command parser that read `namespace`: its flags are the ones
        an unknown flag was meant to be, and its prog is the command the user typed."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(namespace, action.dest, None))
                if isinstance(chosen, CLIParser):
                    return chosen.subcommand_parser(namespace)
        return self

    def suggest(self, extras: Sequence[str]) -> str:
        """' (did you mean --flag?)' for the unknown flags among `extras` that are close to
        one of this parser's flags, else ''."""
        known = [option for action in self._actions for option in action.option_strings]
        typed = [extra.split("=", 1)[0] for extra in extras if extra[:1] in self.prefix_chars]
        close = [match for flag in typed for match in difflib.get_close_matches(flag, known, n=1)]
        return f" (did you mean {', '.join(dict.fromkeys(close))}?)" if close else ""

    def require_cuda(self) -> None:
        """A GPU-only tool's one-line error (exit code 2) where no CUDA device is visible."""
        import torch

        if not torch.cuda.is_available():
            self.error("it measures the CUDA path, and no CUDA device is available here")

    def device(self, name: str):
        """`name` as a torch.device (models.load.resolve_device), or this tool's one-line
        error naming what is wrong with it."""
        from vllm_rlt.models.load import resolve_device

        try:
            return resolve_device(name)
        except ValueError as exc:
            self.error(str(exc))

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def unknown_choice(kind: str, typed: str, choices: Sequence[str]) -> str:
    """The error for a mistyped (sub)command: the closest of `choices`, else all of them."""
    close = difflib.get_close_matches(typed, choices, n=1)
    if close:
        return f"unknown {kind} {typed!r}; did you mean {close[0]!r}?"
    return f"unknown {kind} {typed!r}; choose from {', '.join(choices)}"
