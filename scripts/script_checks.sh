# Sourced by the bench and run scripts: their OUT_DIR argument and numeric settings checked before they
# start anything, each mistake one `[dflash] error:` line naming it, exit 2 (a bare `mkdir: cannot create
# directory` or a `$1: unbound variable` said neither what was wrong nor what to pass).

out_folder() {  # $1: the script's usage line, $2: its OUT_DIR argument; prints the folder's absolute path
  if [ -z "${2:-}" ] || [ "${2#-}" != "$2" ]; then echo "usage: $1" >&2; exit 2; fi
  if [ -e "$2" ] && [ ! -d "$2" ]; then
    echo "[dflash] error: OUT_DIR $2 is a file; pass a folder (a new or an existing one)" >&2; exit 2
  fi
  realpath -m "$2"
}

whole_numbers() {  # the named environment settings, where set, must be whole numbers (seconds, steps, sizes)
  local name
  for name in "$@"; do
    case "${!name:-}" in
      "") ;;
      *[!0-9]*) echo "[dflash] error: $name=${!name}: expected a whole number; set one or unset it for the default" >&2
                exit 2 ;;
    esac
  done
}

known_steps() {  # $1: the script's usage line, then its STEP arguments: each must be one of its functions
  local usage=$1 step
  shift
  [ $# -gt 0 ] || { echo "usage: $usage" >&2; exit 2; }
  for step in "$@"; do
    declare -F "$step" > /dev/null || {
      echo "[dflash] error: unknown step '$step'; see the steps at the top of the script ($usage)" >&2; exit 2; }
  done
}
