#!/bin/sh
''':'
# This file is both a POSIX shell script and a Python program.
#   bash launch.sh RECIPE [key=value ...]       checks the recipe, data and run directory, then starts
#                                                the DeepSpeed launcher with the process count the recipe needs
#   deepspeed [--hostfile H] launch.sh RECIPE    the launcher runs this file with python on every rank
cd "$(dirname "$0")" || exit 1
. ./scripts/setup_env.sh
if [ $# -lt 1 ]; then echo "usage: bash launch.sh RECIPE [key=value ...] [--dry-run]" >&2; exit 2; fi
for a in "$@"; do
  if [ "$a" = "--dry-run" ]; then exec "$PYTHON" -m dflash_ds.train "$@"; fi
done
# The pre-launch checks print shell assignments. Whatever way they fail (a user's error: one line and
# exit 2; a crash: its traceback), nothing is started.
# A DFLASH_PORT set by the caller is the launcher's rendezvous port (runs started together on one host
# each pass their own: scripts/quality_lab.sh sweep); unset, the checks pick a free one.
export DFLASH_REQUESTED_PORT=${DFLASH_PORT:-}
unset DFLASH_PROCS DFLASH_PORT DFLASH_STOP_GRACE
# Ctrl-C during the checks (often during the data preparation) is theirs to report: the shell waits for
# their one line instead of dying with them (a trap, unlike an ignored signal, leaves them the default).
trap ':' INT
DFLASH_VARS=$("$PYTHON" -m dflash_ds.guard.launch "$@") || exit $?
trap - INT
eval "$DFLASH_VARS" || exit 1
if [ -z "${DFLASH_PROCS:-}" ] || [ -z "${DFLASH_PORT:-}" ] || [ -z "${DFLASH_STOP_GRACE:-}" ]; then
  echo "[dflash] error: the pre-launch checks gave no launch settings (see above); nothing was started" >&2
  exit 1
fi
# The launcher and the ranks run in their own process group under a small supervisor (this PID):
# a signal to it stops the whole job (a checkpoint first, see docs/operating.md). The launcher is the
# `deepspeed` command's own module, run by $PYTHON: no `deepspeed` script need be on PATH (a package
# installed with pip --target has none there) and the ranks get the interpreter the checks ran in.
exec "$PYTHON" -m dflash_ds.guard.supervise --grace "$DFLASH_STOP_GRACE" -- \
  "$PYTHON" -m deepspeed.launcher.runner --num_gpus "$DFLASH_PROCS" --master_port "$DFLASH_PORT" launch.sh "$@"
'''
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dflash_ds.train import main  # noqa: E402

sys.exit(main([a for a in sys.argv[1:] if not a.startswith("--local_rank")]))
