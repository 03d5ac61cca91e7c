"""`python -m lab.settings HERE OUT [STEP ARG...]`: scripts/quality_lab.sh's folder and every
LAB_* setting of its environment checked before the script starts anything (its first line runs this).

A setting the shell reads as a number and finds none used to fail late: `sleep abc` after the sweep
had started its runs (left running with nobody waiting for them), `[ $x -ge abc ]` printed every 2 s
with the time box never applied, `abc: unbound variable` in an arithmetic expansion. Each wrong value
is one `[dflash] error:` line naming the setting and what it takes, exit 2; a LAB_* name the lab does
not read is one warning line (a mistyped name would otherwise be ignored without a word)."""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import sys
from pathlib import Path

# Whole seconds or counts (the script does shell arithmetic on them): the least value each takes and
# an example for the message.
INTEGERS = {"LAB_STEPS": (1, 100), "LAB_COMMAND_SECONDS": (0, 540), "LAB_SWEEP_SECONDS": (0, 400),
            "LAB_STOP_GRACE": (0, 60), "LAB_EVAL_RESERVE": (0, 120), "LAB_SWEEP_MIN": (0, 180),
            "LAB_REGEN_MIN": (0, 150), "LAB_EVAL_MIN": (0, 60), "LAB_START_MARGIN": (0, 150),
            "LAB_TRAIN_SECONDS": (1, 600)}
# Seconds handed to `sleep` or to an option that takes a fraction: (least value, whether it must exceed it).
NUMBERS = {"LAB_SWEEP_STAGGER": (0.0, False), "LAB_REGEN_SECONDS": (0.0, True), "LAB_EVAL_SECONDS": (0.0, True)}
# Extra arguments of one `python -m lab STEP`: checked by that step's own parser.
STEP_ARGS = {"LAB_TARGET_ARGS": "target", "LAB_FRAME_ARGS": "frame", "LAB_REGEN_ARGS": "regenerate"}
OTHERS = ("LAB_DIR", "LAB_OVERRIDES", "LAB_REGEN_BENCH", "LAB_REGEN_BENCH_ARGS")
KNOWN = (*INTEGERS, *NUMBERS, *STEP_ARGS, *OTHERS)
# The recipe LAB_OVERRIDES is checked against (the regeneration's; every run's recipe has its keys).
OVERRIDES_RECIPE = "recipes/lab/v1.yaml"


class SettingError(ValueError):
    """A lab setting the script cannot use; the message names it and what it takes."""


def _integer(name: str, text: str, least: int, example: int) -> None:
    # Digits only: what shell arithmetic and `[ -ge ]` read (Python's int would also take "5_0" or " 5").
    if not (re.fullmatch(r"[0-9]+", text) and int(text) >= least):
        raise SettingError(f"{name}={text!r}: expected a whole number >= {least}; set e.g. {name}={example}")


def _number(name: str, text: str, least: float, above: bool) -> None:
    # A plain decimal, as `sleep` and the steps' options read it (not Python's "1_0" or "infinity").
    ok = re.fullmatch(r"[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?", text) is not None and math.isfinite(float(text))
    if not (ok and (float(text) > least if above else float(text) >= least)):
        raise SettingError(f"{name}={text!r}: expected a finite number of seconds {'>' if above else '>='} {least:g}; "
                           f"set e.g. {name}=5")


def _folder(name: str, path: Path, shown: str) -> None:
    if path.exists() and not path.is_dir():
        raise SettingError(f"{name} {shown} is a file; pass a folder (a new or an existing one)")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise SettingError(f"{name} {shown}: {parent} is a file, so no folder can be made under it")
            return


def _step_args(name: str, step: str, text: str) -> None:
    from lab.__main__ import parser

    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[step]
    for action in sub._actions:
        # Only what the setting gives is checked here: the defaults' files are made by earlier steps.
        action.default, action.required = None, False

    def refuse(message: str):  # the step's parser's error hook: the setting's name, not the step's usage
        raise SettingError(f"{name}={text!r} (arguments of python -m lab {step}): {message}")

    sub.error = refuse
    try:
        tokens = shlex.split(text)
    except ValueError as e:
        raise SettingError(f"{name}={text!r}: not a list of arguments ({e}); quote it as a shell would") from None
    sub.parse_args(tokens)


def _overrides(text: str, lab_dir: str) -> None:
    from dflash_ds.config import RecipeError, load_recipe

    items = text.split()
    bad = [item for item in items if "=" not in item]
    if bad:
        raise SettingError(f"LAB_OVERRIDES: {bad[0]!r} is not a recipe setting key.sub=value; e.g. "
                           "LAB_OVERRIDES='optim.max_steps=4 run.device=cpu'")
    paths = [f"target.path={lab_dir}/target", f"data.path={lab_dir}/conversations/train.jsonl"]
    try:
        load_recipe(OVERRIDES_RECIPE, paths + items)
    except RecipeError as e:
        raise SettingError(f"LAB_OVERRIDES: {e}") from None


def check(env: dict[str, str], here: Path, out: str | None, step: list[str]) -> list[str]:
    """Raise SettingError for the first setting the script cannot use; return the warning lines (LAB_*
    names the lab does not read). `here`: where the script was started (OUT is relative to it); LAB_DIR
    is relative to the repository, the working directory of this check."""
    if out is not None:
        _folder("OUT", here / out, out)
    # An empty value is the script's default (it reads each as ${NAME:-default}).
    for name, (least, example) in INTEGERS.items():
        if env.get(name, "") != "":
            _integer(name, env[name], least, example)
    for name, (least, above) in NUMBERS.items():
        if env.get(name, "") != "":
            _number(name, env[name], least, above)
    lab_dir = env.get("LAB_DIR") or "runs/lab"
    _folder("LAB_DIR", Path(lab_dir), lab_dir)
    for name, sub in STEP_ARGS.items():
        if env.get(name, "").strip():
            _step_args(name, sub, env[name])
    if env.get("LAB_OVERRIDES", "").strip():
        _overrides(env["LAB_OVERRIDES"], lab_dir)
    while step and step[0] == "detach":  # a detached step's own arguments, checked before it is started
        step = step[1:]
    if step[:1] == ["wait"] and len(step) > 1:
        _integer("wait SECONDS", step[1], 0, 300)
    unknown = sorted(k for k in env if k.startswith("LAB_") and k not in KNOWN)
    return [f"{k} is not a setting of scripts/quality_lab.sh (it reads {', '.join(KNOWN)}); it is ignored"
            for k in unknown]


def main(argv: list[str] | None = None) -> int:
    from dflash_ds.safety import Exit, say

    argv = sys.argv[1:] if argv is None else argv
    here, out, step = Path(argv[0]), (argv[1] if len(argv) > 1 else None), list(argv[2:])
    try:
        warnings = check(dict(os.environ), here, out, step)
    except SettingError as e:
        say(f"error: {e}; nothing was started")
        return Exit.USER
    for line in warnings:
        say(f"warning: {line}")
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main())
