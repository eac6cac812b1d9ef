#!/usr/bin/env bash
# The real compose deployment, end to end, on this machine (root, Debian; not part of CI). This script sets the
# machine up; the scenarios are Python (tests/compose_scenarios.py), run on the deployment code of fl_app:
#   1. tools: Docker engine (Debian docker.io), Compose v2 and buildx (Debian trixie's docker-compose and
#      docker-buildx packages unpacked into $DOCKER_CONFIG/cli-plugins) where absent; the project's .venv
#      (scripts/setup.sh) for the flwr CLI, unless PYTHON names an interpreter that has them
#   2. daemon: a running one is used; else `dockerd --iptables=false --ip-masq=false --ip-forward=false
#      --bridge=none` (niced, own log file, stopped by its pid at the end, also on failure or Ctrl-C)
#   3. base image: Flower's flwr/superexec:1.42.0-py3.11-ubuntu24.04 where it can be had; else a stand-in
#      with its layout (docker/base.Dockerfile on a debootstrap minbase bookworm rootfs), reused once built
#   4. the project image (Dockerfile) on that base: host network, this machine's CA bundle as build secret
#   5. tests/compose_scenarios.py: plain stack (docker-compose.yml), 3 SuperNodes online, a run of $ROUNDS
#      rounds on digits (MLP); a run in which one SuperNode's containers are killed after round 1 must still
#      complete; `down -v`; python -m alignfl.fl_app.deploy (what ./scripts/deploy.sh runs: the same topology as local
#      processes) with the same seed and run config, final accuracies compared; TLS + SuperNode authentication
#      stack (compose.tls.yml, keys from scripts/make_certs.sh): a SuperNode with an unregistered key is refused, a
#      run completes; `down -v`. No container, network or volume of the project is left, the daemon is stopped.
# Prints a report (steps, wall time, image sizes, PASS/FAIL) and exits non-zero on any failure.
#
#   scripts/compose_check.sh [--work-dir DIR]
# Environment: FLWR_IMAGE (use this base image), PYTHON (the interpreter with the project and the flwr CLI;
# default .venv/bin/python, set up by scripts/setup.sh), ROUNDS (2), SEED (0), RUN_TIMEOUT_S (1800: the longest a
# run may take; a run that hangs fails the step), KILL_MIN_NODES (2: min-available-nodes of the node-kill run),
# KILL_ROUNDS (3: its rounds; round 2 samples the dead node before the SuperLink marks it offline, round 3 after),
# SKIP (steps to leave out, any of: kill loopback tls),
# COMPARE_TOL (0.02: largest accepted |compose - loopback| final accuracy), NICE (10), DEBIAN_MIRROR,
# CA_BUNDLE (/etc/ssl/certs/ca-certificates.crt: trusted inside the builds).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

. scripts/check_options.sh
parse_check_options "$0" "$@"

IMAGE=alignfl:flwr-1.42.0                                  # docker-compose.yml's image
UPSTREAM_IMAGE=flwr/superexec:1.42.0-py3.11-ubuntu24.04      # the Dockerfile's default FLWR_IMAGE
STANDIN_IMAGE=alignfl-base:flwr-1.42.0-py3.11-bookworm
ROOTFS_IMAGE=alignfl-rootfs:bookworm-minbase
TORCH_INDEX_DEFAULT=https://download.pytorch.org/whl/cpu     # the Dockerfile's default TORCH_INDEX
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
ROUNDS=${ROUNDS:-}
SEED=${SEED:-}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-}
BUILD_TIMEOUT_S=${BUILD_TIMEOUT_S:-5400}
KILL_MIN_NODES=${KILL_MIN_NODES:-}
KILL_ROUNDS=${KILL_ROUNDS:-}
SKIP=${SKIP:-}
COMPARE_TOL=${COMPARE_TOL:-}
NICE=${NICE:-10}
PLUGINS=${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins

WORK=${WORK:-$(mktemp -d /tmp/alignfl-compose-check.XXXXXX)}
mkdir -p "$WORK/logs" && WORK=$(cd "$WORK" && pwd)
LOGS=$WORK/logs
T0=$SECONDS
FAILED=0
DOCKERD_PID=""
FLWR_IMAGE=${FLWR_IMAGE:-}
PYTHON=${PYTHON:-}
STEP_NAMES=() STEP_SECS=() STEP_RESULTS=() STEP_NOTES=()
NOTE=""
FACTS=()
CURRENT_STEP="" CURRENT_START=0

log() { printf '[compose-check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
fact() { FACTS+=("$*"); log "$*"; }
tail_of() { [ -f "$1" ] && { echo "--- last lines of $1:"; tail -n "${2:-25}" "$1"; echo "---"; }; }
human() { awk -v b="$1" 'BEGIN { printf (b >= 1e9 ? "%.2f GB" : "%.0f MB"), (b >= 1e9 ? b / 1e9 : b / 1e6) }'; }

record() { STEP_NAMES+=("$1"); STEP_SECS+=("$2"); STEP_RESULTS+=("$3"); STEP_NOTES+=("$4"); }

# step critical|check NAME FUNCTION [ARGS]: time it, record PASS/FAIL and NOTE; a failed critical step ends the
# check (cleanup and report follow from the EXIT trap), a failed check step is recorded and the rest goes on.
step() {
  local kind=$1 name=$2 start=$SECONDS rc
  shift 2
  log "== $name"
  NOTE=""
  CURRENT_STEP=$name CURRENT_START=$start
  "$@"
  rc=$?
  CURRENT_STEP=""
  record "$name" $((SECONDS - start)) "$([ $rc = 0 ] && echo PASS || echo FAIL)" "$NOTE"
  if [ $rc != 0 ]; then
    FAILED=1
    log "FAILED: $name${NOTE:+: $NOTE}"
    [ "$kind" = critical ] && exit 1
  fi
  return 0
}

# --- 1. tools ---

apt_install() {
  log "apt-get install $*"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"; } >>"$LOGS/apt.log" 2>&1 \
    || { tail_of "$LOGS/apt.log"; return 1; }
}

# Debian trixie's docker-compose (v2) and docker-buildx packages, unpacked into the Docker CLI's plugin folder
# (bookworm has Compose v1.29 only, which rejects the compose file's top-level `name:`, and no buildx).
trixie_plugins() {
  local apt_dir=$WORK/trixie-apt deb
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/debs" "$apt_dir/root" "$PLUGINS"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $DEBIAN_MIRROR trixie main" \
    >"$apt_dir/sources.list"
  local opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/nonexistent
              -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o APT::Sandbox::User=root)
  log "fetching $* from Debian trixie into $PLUGINS"
  { apt-get "${opts[@]}" update -qq && (cd "$apt_dir/debs" && apt-get "${opts[@]}" download "$@"); } \
    >>"$LOGS/apt.log" 2>&1 || { tail_of "$LOGS/apt.log"; return 1; }
  for deb in "$apt_dir"/debs/*.deb; do dpkg-deb -x "$deb" "$apt_dir/root" || return 1; done
  install -m 755 "$apt_dir"/root/usr/libexec/docker/cli-plugins/docker-* "$PLUGINS/" || return 1
  rm -rf "$apt_dir"
}

compose_v2() {  # `docker compose` is Compose v2 or later
  local v
  v=$(docker compose version --short 2>/dev/null) || return 1
  v=${v#v}
  [ "${v%%.*}" -ge 2 ] 2>/dev/null
}

step_tools() {
  local missing=() plugins=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v curl >/dev/null || missing+=(curl)
  command -v openssl >/dev/null || missing+=(openssl)
  command -v ssh-keygen >/dev/null || missing+=(openssh-client)
  [ ${#missing[@]} = 0 ] || apt_install "${missing[@]}" || { NOTE="apt-get install ${missing[*]} failed"; return 1; }
  command -v docker >/dev/null || { NOTE="no docker client after installing docker.io"; return 1; }
  compose_v2 || plugins+=(docker-compose)
  docker buildx version >/dev/null 2>&1 || plugins+=(docker-buildx)
  [ ${#plugins[@]} = 0 ] || trixie_plugins "${plugins[@]}" || { NOTE="could not fetch ${plugins[*]} from trixie"; return 1; }
  compose_v2 || { NOTE="docker compose is not v2: $(docker compose version 2>&1 | head -1)"; return 1; }
  docker buildx version >/dev/null 2>&1 || { NOTE="docker buildx unusable"; return 1; }
  if [ -z "$PYTHON" ]; then
    ./scripts/setup.sh >"$LOGS/setup.log" 2>&1 || { tail_of "$LOGS/setup.log"; NOTE="scripts/setup.sh failed"; return 1; }
    PYTHON=$ROOT/.venv/bin/python
  fi
  PYTHONPATH="$ROOT/tests:$ROOT" "$PYTHON" -c 'import compose_scenarios, flwr' 2>"$LOGS/python.log" \
    || { tail_of "$LOGS/python.log"; NOTE="$PYTHON cannot import the project and flwr"; return 1; }
  NOTE="docker $(docker version --format '{{.Client.Version}}' 2>/dev/null) client, compose $(docker compose version --short), buildx $(docker buildx version | awk '{print $2}')${missing[*]:+; installed ${missing[*]}}${plugins[*]:+; plugins ${plugins[*]} from trixie}"
  return 0
}

# --- 2. daemon ---

step_daemon() {
  if docker info >/dev/null 2>&1; then
    NOTE="a Docker daemon was already running: used as it is (not stopped at the end)"
    return 0
  fi
  # its own session: Ctrl-C reaches this script (whose trap stops the stacks, then the daemon), not the daemon
  setsid nice -n "$NICE" dockerd --iptables=false --ip-masq=false --ip-forward=false --bridge=none \
    >"$LOGS/dockerd.log" 2>&1 </dev/null &
  DOCKERD_PID=$!
  echo "$DOCKERD_PID" >"$WORK/dockerd.pid"
  local deadline=$((SECONDS + 90))
  until docker info >/dev/null 2>&1; do
    if ! kill -0 "$DOCKERD_PID" 2>/dev/null || [ $SECONDS -gt $deadline ]; then
      tail_of "$LOGS/dockerd.log"; NOTE="dockerd did not come up (log: $LOGS/dockerd.log)"; return 1
    fi
    sleep 1
  done
  [ "$(cat "/proc/$DOCKERD_PID/comm" 2>/dev/null)" = dockerd ] \
    || { NOTE="pid $DOCKERD_PID is not dockerd"; return 1; }
  NOTE="started dockerd pid $DOCKERD_PID (nice $NICE, engine $(docker version --format '{{.Server.Version}}'), storage $(docker info --format '{{.Driver}}'), log $LOGS/dockerd.log)"
  return 0
}

# --- 3. base image ---

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

build_secret_args() {  # this machine's CA bundle (the local CAs update-ca-certificates added included)
  [ -s "$CA_BUNDLE" ] && echo "--secret id=ca_bundle,src=$CA_BUNDLE"
}

# pip's index settings of this host that can work inside a build (http/https; file:// ones are host paths),
# one argument a line: read them with mapfile (an extra-index-url may list several URLs)
pip_index_args() {
  local key value url extra=()
  while IFS='=' read -r key value; do
    value=${value#\'}; value=${value%\'}
    case "$key" in
      *.index-url) case "$value" in http://*|https://*) printf '%s\n' --build-arg "PIP_INDEX_URL=$value";; esac;;
      *.extra-index-url) for url in $value; do case "$url" in http://*|https://*) extra+=("$url");; esac; done;;
    esac
  done < <(python3 -m pip config list 2>/dev/null)
  [ ${#extra[@]} = 0 ] || printf '%s\n' --build-arg "PIP_EXTRA_INDEX_URL=${extra[*]}"
}

step_base_image() {
  if [ -n "$FLWR_IMAGE" ]; then
    have_image "$FLWR_IMAGE" || timeout --foreground 300 docker pull "$FLWR_IMAGE" >"$LOGS/pull.log" 2>&1 \
      || { NOTE="FLWR_IMAGE=$FLWR_IMAGE is neither here nor pullable"; return 1; }
    NOTE="FLWR_IMAGE=$FLWR_IMAGE as given"; return 0
  fi
  if have_image "$UPSTREAM_IMAGE"; then FLWR_IMAGE=$UPSTREAM_IMAGE; NOTE="Flower's $UPSTREAM_IMAGE (present)"; return 0; fi
  if have_image "$STANDIN_IMAGE"; then
    FLWR_IMAGE=$STANDIN_IMAGE
    NOTE="reused the stand-in $STANDIN_IMAGE ($(human "$(docker image inspect -f '{{.Size}}' "$STANDIN_IMAGE")"))"
    return 0
  fi
  if timeout --foreground 120 docker pull "$UPSTREAM_IMAGE" >"$LOGS/pull.log" 2>&1; then
    FLWR_IMAGE=$UPSTREAM_IMAGE; NOTE="pulled Flower's $UPSTREAM_IMAGE"; return 0
  fi
  fact "no registry: 'docker pull $UPSTREAM_IMAGE' failed ($(tail -n 1 "$LOGS/pull.log" | cut -c1-160)); building the stand-in $STANDIN_IMAGE"
  if ! have_image "$ROOTFS_IMAGE"; then
    command -v debootstrap >/dev/null || apt_install debootstrap || { NOTE="cannot install debootstrap"; return 1; }
    local rootfs=$WORK/rootfs
    log "debootstrap --variant=minbase bookworm from $DEBIAN_MIRROR (log: $LOGS/debootstrap.log)"
    nice -n "$NICE" debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,libsqlite3-0 \
      bookworm "$rootfs" "$DEBIAN_MIRROR" >"$LOGS/debootstrap.log" 2>&1 \
      || { tail_of "$LOGS/debootstrap.log"; NOTE="debootstrap failed"; return 1; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/tmp/* 2>/dev/null
    tar -C "$rootfs" --numeric-owner -c . | docker import --change 'CMD ["/bin/bash"]' - "$ROOTFS_IMAGE" \
      >>"$LOGS/debootstrap.log" 2>&1 || { NOTE="docker import of the rootfs failed"; return 1; }
    rm -rf "$rootfs"
  fi
  local pip_args; mapfile -t pip_args < <(pip_index_args)
  # shellcheck disable=SC2046
  nice -n "$NICE" timeout --foreground "$BUILD_TIMEOUT_S" docker buildx build --progress plain --network host \
    $(build_secret_args) "${pip_args[@]}" --build-arg "ROOTFS_IMAGE=$ROOTFS_IMAGE" \
    -f docker/base.Dockerfile -t "$STANDIN_IMAGE" docker >"$LOGS/build-base.log" 2>&1 \
    || { tail_of "$LOGS/build-base.log" 40; NOTE="building docker/base.Dockerfile failed (log: $LOGS/build-base.log)"; return 1; }
  FLWR_IMAGE=$STANDIN_IMAGE
  NOTE="built the stand-in $STANDIN_IMAGE ($(human "$(docker image inspect -f '{{.Size}}' "$STANDIN_IMAGE")")) on $ROOTFS_IMAGE"
  return 0
}

# --- 4. project image ---

IMAGE_SIZE=""
step_image() {
  local torch_index=$TORCH_INDEX_DEFAULT
  if ! curl -fsS -m 20 -o /dev/null "$TORCH_INDEX_DEFAULT/torch/" 2>/dev/null; then
    torch_index=""
    fact "torch: $TORCH_INDEX_DEFAULT is unreachable, so the image gets PyPI's torch (CUDA wheels: a much larger image)"
  fi
  local secret; secret=$(build_secret_args)
  [ -n "$secret" ] && fact "builds trust $CA_BUNDLE (build secret ca_bundle; local CAs: $(ls /usr/local/share/ca-certificates 2>/dev/null | tr '\n' ' '))"
  local pip_args; mapfile -t pip_args < <(pip_index_args)
  [ ${#pip_args[@]} = 0 ] || fact "pip indexes of this host passed to the builds: ${pip_args[*]}"
  log "docker buildx build -t $IMAGE (FLWR_IMAGE=$FLWR_IMAGE; log: $LOGS/build-image.log)"
  # shellcheck disable=SC2086
  nice -n "$NICE" timeout --foreground "$BUILD_TIMEOUT_S" docker buildx build --progress plain --network host $secret \
    "${pip_args[@]}" --build-arg "FLWR_IMAGE=$FLWR_IMAGE" --build-arg "TORCH_INDEX=$torch_index" \
    -t "$IMAGE" . >"$LOGS/build-image.log" 2>&1 \
    || { tail_of "$LOGS/build-image.log" 40; NOTE="image build failed (log: $LOGS/build-image.log)"; return 1; }
  IMAGE_SIZE=$(human "$(docker image inspect -f '{{.Size}}' "$IMAGE")")
  local versions
  versions=$(docker run --rm --network none --entrypoint python "$IMAGE" -c \
    'import flwr, torch, sys; print(f"python {sys.version.split()[0]}, flwr {flwr.__version__}, torch {torch.__version__}")' 2>&1) \
    || { NOTE="the image does not import flwr/torch: $versions"; return 1; }
  NOTE="$IMAGE: $IMAGE_SIZE; $versions; torch from ${torch_index:-PyPI}; cached layers: $(grep -c ' CACHED' "$LOGS/build-image.log" || true)"
  return 0
}

# --- 5. the scenarios (tests/compose_scenarios.py) ---

# in the background, so that a stop signal reaches this script's trap at once, which passes it on and waits
SCENARIOS_PID=""
run_scenarios() {  # its steps go to $WORK/steps.tsv, which the report reads (scenario_steps)
  log "$PYTHON tests/compose_scenarios.py (log lines below; its steps are in the report)"
  # its defaults are the settings' own: only the variables that are set are passed
  (cd "$ROOT" && PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" tests/compose_scenarios.py --work-dir "$WORK" ${ROUNDS:+--rounds "$ROUNDS"} \
     ${SEED:+--seed "$SEED"} ${RUN_TIMEOUT_S:+--run-timeout "$RUN_TIMEOUT_S"} \
     ${KILL_MIN_NODES:+--kill-min-nodes "$KILL_MIN_NODES"} ${KILL_ROUNDS:+--kill-rounds "$KILL_ROUNDS"} \
     ${COMPARE_TOL:+--compare-tol "$COMPARE_TOL"} --skip "$SKIP") &
  SCENARIOS_PID=$!
  wait "$SCENARIOS_PID" || FAILED=1
  SCENARIOS_PID=""
}

scenario_steps() {  # tests/compose_scenarios.py's records (result, seconds, step, note; or a note), into the report
  local result secs name note
  [ -f "$WORK/steps.tsv" ] || return 0
  while IFS=$'\t' read -r result secs name note; do
    if [ "$result" = note ]; then FACTS+=("$note"); continue; fi
    record "$name" "$secs" "$result" "$note"
    [ "$result" = PASS ] || FAILED=1
  done <"$WORK/steps.tsv"
}

# --- cleanup (also on failure and Ctrl-C) and report ---

engine_processes() {
  local proc comm
  for proc in /proc/[0-9]*; do
    comm=$(cat "$proc/comm" 2>/dev/null)
    case "$comm" in dockerd|containerd|containerd-shim*|docker-proxy) printf ' %s(%s)' "${proc#/proc/}" "$comm";; esac
  done
}

stop_daemon() {
  local pid=$DOCKERD_PID children
  children=$(pgrep -P "$pid" 2>/dev/null | xargs)   # its containerd and docker-proxy processes
  kill -TERM "$pid" 2>/dev/null
  local deadline=$((SECONDS + 90))
  while [ -d "/proc/$pid" ] && [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]; do
    if [ $SECONDS -gt $deadline ]; then log "dockerd $pid ignored SIGTERM for 90 s: SIGKILL"; kill -KILL "$pid"; fi
    sleep 1
  done
  wait "$pid" 2>/dev/null
  local left="" child
  for child in $children; do
    for _ in $(seq 30); do [ -d "/proc/$child" ] || break; sleep 1; done
    [ -d "/proc/$child" ] && left="$left $child($(cat "/proc/$child/comm" 2>/dev/null))"
  done
  [ -d "/proc/$pid" ] && left="$left $pid(dockerd)"
  # nothing of the engine may be left at all: no dockerd, containerd, shim or docker-proxy process (a read-only
  # look at /proc; a shim may take a few seconds to follow its containerd)
  local engine
  for _ in $(seq 30); do engine=$(engine_processes); [ -z "$engine" ] && break; sleep 1; done
  left="$left$engine"
  if [ -n "$left" ]; then NOTE="still running:$left"; return 1; fi
  NOTE="dockerd pid $pid stopped${children:+ (its children $children exited too)}; no dockerd, containerd, shim or docker-proxy process left"
  return 0
}

cleanup() {
  local rc=$?
  trap '' INT TERM  # a second Ctrl-C does not cut the cleanup short
  trap - EXIT
  if [ -n "$CURRENT_STEP" ]; then  # the step that was running when the check was interrupted or ended
    record "$CURRENT_STEP" $((SECONDS - CURRENT_START)) FAIL "did not finish (exit status $rc$([ $rc = 130 ] && echo ': interrupted'))"
    FAILED=1
  fi
  if [ -n "$SCENARIOS_PID" ]; then  # interrupted: it takes its stacks down, then ends
    kill -TERM "$SCENARIOS_PID" 2>/dev/null
    wait "$SCENARIOS_PID"
    FAILED=1
  fi
  scenario_steps
  if [ -n "$DOCKERD_PID" ]; then
    local start=$SECONDS
    NOTE=""
    if stop_daemon; then record "stop dockerd" $((SECONDS - start)) PASS "$NOTE"
    else record "stop dockerd" $((SECONDS - start)) FAIL "$NOTE"; FAILED=1; fi
  fi
  report
  [ $rc = 0 ] && [ $FAILED = 1 ] && rc=1
  exit $rc
}

report() {
  local i total=$((SECONDS - T0))
  echo
  echo "==================== compose_check report ===================="
  printf '%-4s  %6s  %s\n' RESULT "SECS" STEP
  for i in "${!STEP_NAMES[@]}"; do
    printf '%-4s  %6s  %s\n' "${STEP_RESULTS[$i]}" "${STEP_SECS[$i]}" "${STEP_NAMES[$i]}"
    [ -z "${STEP_NOTES[$i]}" ] || printf '              %s\n' "${STEP_NOTES[$i]}" | fold -s -w 118 | sed '2,$s/^/              /'
  done
  for i in "${FACTS[@]}"; do printf 'note: %s\n' "$i" | fold -s -w 118; done
  echo "image: $IMAGE ${IMAGE_SIZE:-?} (base ${FLWR_IMAGE:-?})"
  echo "work folder (logs, results, keys): $WORK"
  echo "total wall time: $((total / 60)) min $((total % 60)) s"
  if [ $FAILED = 0 ] && [ ${#STEP_NAMES[@]} -gt 0 ]; then echo "RESULT: PASS"; else echo "RESULT: FAIL"; fi
  echo "=============================================================="
}

trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

[ "$(id -u)" = 0 ] || { echo "compose_check.sh: run as root (it installs packages and starts dockerd)" >&2; exit 2; }
log "work folder: $WORK"
step critical "tools (docker engine, compose v2, buildx, .venv)" step_tools
step critical "docker daemon" step_daemon
step critical "base image (FLWR_IMAGE)" step_base_image
step critical "project image (Dockerfile)" step_image
run_scenarios
