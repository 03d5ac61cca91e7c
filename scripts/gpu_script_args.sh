# Sourced by the one-GPU bench scripts (`. "$(dirname "$0")/gpu_script_args.sh" "$@"`): reads
# `OUT_DIR [--cpu]` into OUT (absolute) and MODE (gpu or cpu; usage errors exit 2), moves to the repository
# root, picks the project's Python ($PYTHON, scripts/setup_env.sh), creates OUT and sets the offline environment.
_script=$(basename "$0")
. "$(dirname "$0")/script_checks.sh"
OUT=$(out_folder "bash scripts/$_script OUT_DIR [--cpu]" "${1:-}") || exit 2
shift
MODE=gpu
for a in "$@"; do
  case $a in
    --cpu) MODE=cpu ;;
    *) echo "$_script: unknown option $a (only --cpu)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.." || exit 1
. ./scripts/setup_env.sh
mkdir -p "$OUT" || exit 1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
