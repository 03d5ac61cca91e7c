"""Command-line arguments checked as they are parsed, before anything loads or starts: each wrong value
is one `[dflash] error: ...` line naming the argument, what it takes and what was given, exit 2.

`Parser` is argparse's parser with that one line instead of the usage block (and its subcommands
alike); the `type=` converters below refuse what argparse's `int` and `float` take but no setting
means: nan, inf, a negative count, a zero where at least one is needed, a file where a folder is
wanted (or the reverse), JSON that is not an object."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Callable

from dflash_ds.safety import Exit, say


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line naming the argument and the fix, status 2."""

    def error(self, message: str):  # argparse's hook: called for every bad or missing argument
        say(f"error: {self.prog}: {message} (see {self.prog} --help)")
        raise SystemExit(int(Exit.USER))


def integer(minimum: int = 0) -> Callable[[str], int]:
    """An integer >= `minimum` (0 for a seed or a count that may be empty, 1 for a size)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def integers(minimum: int = 1) -> Callable[[str], list[int]]:
    """A comma-separated list of integers >= `minimum` (empty: none)."""
    one = integer(minimum)

    def parse(text: str) -> list[int]:
        try:
            return [one(item.strip()) for item in text.split(",") if item.strip()]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected integers >= {minimum} separated by commas, got {text!r}") from None

    parse.__name__ = f"list of integers >= {minimum}"
    return parse


def number(minimum: float = 0.0, *, above: bool = False) -> Callable[[str], float]:
    """A finite number >= `minimum` (> with `above`): nan and inf mean no rate, time or temperature."""
    bound = f"{'>' if above else '>='} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a finite number {bound}, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (above and value == minimum):
            raise argparse.ArgumentTypeError(f"expected a finite number {bound}, got {text!r}")
        return value

    parse.__name__ = f"number {bound}"
    return parse


def existing_file(text: str) -> str:
    """A path to a file that exists (a folder or nothing there is refused)."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; pass a file")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} does not exist; pass an existing file")
    return text


def existing_folder(text: str) -> str:
    """A path to a folder that exists (a file or nothing there is refused)."""
    path = Path(text).expanduser()
    if path.is_file():
        raise argparse.ArgumentTypeError(f"{text} is a file; pass a folder")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} does not exist; pass an existing folder")
    return text


def model_folder(text: str) -> str:
    """A model: a local folder, or a hub id (org/name) when nothing of that name is here; a file is refused."""
    if Path(text).expanduser().is_file():
        raise argparse.ArgumentTypeError(f"{text} is a file; pass the model's folder (config.json and weights) or a "
                                         "hub id")
    return text


def output_file(text: str) -> str:
    """Where a file will be written: not a folder, and no file on the way to it."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; pass a file path to write")
    _no_file_above(text, path)
    return text


def output_folder(text: str) -> str:
    """Where a folder will be written (or added to): not a file, and no file on the way to it."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; pass a folder (a new or an existing one)")
    _no_file_above(text, path)
    return text


def _no_file_above(text: str, path: Path) -> None:
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise argparse.ArgumentTypeError(f"{text}: {parent} is a file, so nothing can be written under it")
            return


# Chat-template flags that a template tests for truth: a string such as "false" or "maybe" would be
# taken as true by the template, and the evaluation would silently render another prompt.
BOOLEAN_TEMPLATE_KEYS = ("enable_thinking",)


def json_object(text: str) -> dict:
    """A JSON object (the keyword arguments of a chat template); its known flags must be true or false."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"is not JSON ({e}); pass an object such as "
                                         "'{\"enable_thinking\": false}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of keyword arguments, got {text!r}; pass an "
                                         "object such as '{\"enable_thinking\": false}'")
    for key in BOOLEAN_TEMPLATE_KEYS:
        if key in value and not isinstance(value[key], bool):
            raise argparse.ArgumentTypeError(f"{key} must be true or false, got {json.dumps(value[key])}")
    return value
