# Sourced by the machine checks (compose_check.sh, slurm_check.sh, hosts_check.sh): their shared options.
# parse_check_options SCRIPT ARGS...: sets WORK from --work-dir; --help prints SCRIPT's header comment.
parse_check_options() {
  local script=$1
  shift
  WORK=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --work-dir) WORK=${2:?--work-dir needs a folder}; shift 2;;
      -h|--help) sed -n '2,/^set -/p' "$script" | sed '$d; s/^# \{0,1\}//'; exit 0;;
      *) echo "$(basename "$script"): unknown argument '$1' (see --help)" >&2; exit 2;;
    esac
  done
}
