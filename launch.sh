#!/bin/sh
''':'
# This file is both a POSIX shell script and a Python program.
#   bash launch.sh RECIPE [key=value ...]       sets up the environment, then starts the DeepSpeed
#                                                launcher with the process count the recipe needs
#   deepspeed [--hostfile H] launch.sh RECIPE    the launcher runs this file with python on every rank
cd "$(dirname "$0")" || exit 1
. ./scripts/setup_env.sh
if [ $# -lt 1 ]; then echo "usage: bash launch.sh RECIPE [key=value ...] [--dry-run]" >&2; exit 2; fi
for a in "$@"; do
  if [ "$a" = "--dry-run" ]; then exec "$PYTHON" -m dflash_ds.train "$@"; fi
done
eval "$("$PYTHON" -m dflash_ds.runtime.launch_env "$@")" || exit 1
exec deepspeed --num_gpus "$DFLASH_PROCS" --master_port "$DFLASH_PORT" launch.sh "$@"
'''
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dflash_ds.train import main  # noqa: E402

sys.exit(main([a for a in sys.argv[1:] if not a.startswith("--local_rank")]))
