#!/usr/bin/env bash
# The real compose deployment, end to end, on this machine (root, Debian; not part of CI):
#   1. tools: Docker engine (Debian docker.io), Compose v2 and buildx (Debian trixie's docker-compose and
#      docker-buildx packages unpacked into $DOCKER_CONFIG/cli-plugins) where absent; the project's .venv
#      (scripts/setup.sh) for the flwr CLI
#   2. daemon: a running one is used; else `dockerd --iptables=false --ip-masq=false --ip-forward=false
#      --bridge=none` (niced, own log file, stopped by its pid at the end, also on failure or Ctrl-C)
#   3. base image: Flower's flwr/superexec:1.41.0-py3.11-ubuntu24.04 where it can be had; else a stand-in
#      with its layout (docker/base.Dockerfile on a debootstrap minbase bookworm rootfs), reused once built
#   4. the project image (Dockerfile) on that base: host network, this machine's CA bundle as build secret
#   5. plain stack (docker-compose.yml): 3 SuperNodes online, a run of $ROUNDS rounds on digits (MLP)
#   6. a run in which one SuperNode's containers are killed after round 1 must still complete
#   7. ./scripts/deploy.sh (the same topology as local processes) with the same seed and run config: the final
#      accuracies are compared
#   8. TLS + SuperNode authentication stack (compose.tls.yml, keys from scripts/make_certs.sh): a SuperNode
#      with an unregistered key is refused, a run completes
#   9. `down -v` after each stack; no container, network or volume of the project left, the daemon stopped
# Prints a report (steps, wall time, image sizes, PASS/FAIL) and exits non-zero on any failure.
#
#   scripts/compose_check.sh [--work-dir DIR]
# Environment: FLWR_IMAGE (use this base image), ROUNDS (2), SEED (0), RUN_TIMEOUT_S (1800: the longest a run
# may take; a run that hangs fails the step), KILL_MIN_NODES (2: min-available-nodes of the node-kill run),
# KILL_ROUNDS (3: its rounds; round 2 samples the dead node before the SuperLink marks it offline, round 3 after),
# SKIP (steps to leave out, any of: kill loopback tls),
# COMPARE_TOL (0.02: largest accepted |compose - loopback| final accuracy), NICE (10), DEBIAN_MIRROR,
# CA_BUNDLE (/etc/ssl/certs/ca-certificates.crt: trusted inside the builds).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
WORK=""
while [ $# -gt 0 ]; do
  case "$1" in
    --work-dir) WORK=${2:?--work-dir needs a folder}; shift 2;;
    -h|--help) usage; exit 0;;
    *) echo "compose_check.sh: unknown argument '$1' (see --help)" >&2; exit 2;;
  esac
done

IMAGE=alignfl:flwr-1.41.0                                  # docker-compose.yml's image
UPSTREAM_IMAGE=flwr/superexec:1.41.0-py3.11-ubuntu24.04      # the Dockerfile's default FLWR_IMAGE
STANDIN_IMAGE=alignfl-base:flwr-1.41.0-py3.11-bookworm
ROOTFS_IMAGE=alignfl-rootfs:bookworm-minbase
TORCH_INDEX_DEFAULT=https://download.pytorch.org/whl/cpu     # the Dockerfile's default TORCH_INDEX
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
ROUNDS=${ROUNDS:-2}
SEED=${SEED:-0}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-1800}
BUILD_TIMEOUT_S=${BUILD_TIMEOUT_S:-5400}
KILL_MIN_NODES=${KILL_MIN_NODES:-2}
KILL_ROUNDS=${KILL_ROUNDS:-3}
SKIP=${SKIP:-}
COMPARE_TOL=${COMPARE_TOL:-0.02}
NICE=${NICE:-10}
NODES=3                                                      # the compose files' SuperNodes
PORT=9093
PLUGINS=${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins

WORK=${WORK:-$(mktemp -d /tmp/alignfl-compose-check.XXXXXX)}
mkdir -p "$WORK/logs" && WORK=$(cd "$WORK" && pwd)
LOGS=$WORK/logs
T0=$SECONDS
FAILED=0
DOCKERD_PID=""
FLWR_IMAGE=${FLWR_IMAGE:-}
BG_PIDS=()
STEP_NAMES=() STEP_SECS=() STEP_RESULTS=() STEP_NOTES=()
NOTE=""
FACTS=()
CURRENT_STEP="" CURRENT_START=0

log() { printf '[compose-check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
fact() { FACTS+=("$*"); log "$*"; }
tail_of() { [ -f "$1" ] && { echo "--- last lines of $1:"; tail -n "${2:-25}" "$1"; echo "---"; }; }
human() { awk -v b="$1" 'BEGIN { printf (b >= 1e9 ? "%.2f GB" : "%.0f MB"), (b >= 1e9 ? b / 1e9 : b / 1e6) }'; }
py() { "$ROOT/.venv/bin/python" - "$@"; }

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
  ./scripts/setup.sh >"$LOGS/setup.log" 2>&1 || { tail_of "$LOGS/setup.log"; NOTE="scripts/setup.sh failed"; return 1; }
  export PATH="$ROOT/.venv/bin:$PATH"
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

# --- compose and flwr helpers ---

COMPOSE_FILES=(-f "$ROOT/docker-compose.yml")
# compose [--limit SECONDS] ARGS: docker compose on the current stack's files (ended after SECONDS)
compose() {
  local limit=0
  [ "$1" = --limit ] && { limit=$2; shift 2; }
  timeout --foreground "$limit" docker compose --project-directory "$ROOT" "${COMPOSE_FILES[@]}" "$@"
}

compose_env() {
  export ALIGNFL_RESULTS=$WORK/results ALIGNFL_DATA=$WORK/data ALIGNFL_CERTS=$WORK/certs
  export SUPERLINK_PUBLISH=127.0.0.1:$PORT  # this host only
  mkdir -p "$ALIGNFL_RESULTS" "$ALIGNFL_DATA" && chmod a+rwx "$ALIGNFL_RESULTS" "$ALIGNFL_DATA"  # uid 49999 writes
  if [ ! -d "${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}" ]; then  # digits needs none; mount an empty one
    export FASHION_MNIST_DIR=$WORK/no-fashion-mnist; mkdir -p "$FASHION_MNIST_DIR"
  fi
}

# the flwr CLI's connection to the compose SuperLink (plaintext, or TLS trusting the deployment's CA)
flwr_home() {
  export FLWR_HOME=$WORK/flwr-home-$1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
  mkdir -p "$FLWR_HOME"
  local security='insecure = true'
  [ "$1" = tls ] && security="root-certificates = \"$ALIGNFL_CERTS/ca.crt\""
  printf '[superlink]\ndefault = "alignfl-docker"\n\n[superlink.alignfl-docker]\naddress = "127.0.0.1:%s"\n%s\n' \
    "$PORT" "$security" >"$FLWR_HOME/config.toml"
}

online_supernodes() {
  local listing
  listing=$(timeout --foreground 60 flwr supernode list --format json 2>/dev/null)
  py "$listing" <<'EOF' 2>/dev/null || echo 0
import json, sys
print(sum(node["status"] == "online" for node in json.loads(sys.argv[1])["nodes"]))
EOF
}

# wait_for SECONDS WHAT COMMAND...: poll until COMMAND succeeds
wait_for() {
  local limit=$1 what=$2 deadline=$((SECONDS + $1))
  shift 2
  until "$@"; do
    [ $SECONDS -lt $deadline ] || { NOTE="gave up after ${limit} s waiting for $what"; return 1; }
    sleep 2
  done
}

all_online() { [ "$(online_supernodes)" -ge "$NODES" ]; }
superlink_healthy() {
  if [ "$1" = tls ]; then curl -fsS -m 5 --cacert "$ALIGNFL_CERTS/ca.crt" -o /dev/null "https://127.0.0.1:$PORT/health" 2>/dev/null
  else curl -fsS -m 5 -o /dev/null "http://127.0.0.1:$PORT/health" 2>/dev/null; fi
}

# up MODE: start the stack, wait for the SuperLink and every SuperNode
up() {
  local mode=$1
  if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then NOTE="127.0.0.1:$PORT is already in use"; return 1; fi
  compose --limit 600 up -d --no-build >"$LOGS/up-$mode.log" 2>&1 \
    || { tail_of "$LOGS/up-$mode.log"; compose logs --no-color >"$LOGS/compose-$mode.log" 2>&1
         tail_of "$LOGS/compose-$mode.log" 40; NOTE="compose up failed (log: $LOGS/up-$mode.log)"; return 1; }
  flwr_home "$mode"
  wait_for 180 "the SuperLink's health endpoint" superlink_healthy "$mode" || return 1
  wait_for 300 "$NODES SuperNodes online" all_online \
    || { compose logs --no-color >"$LOGS/compose-$mode.log" 2>&1; tail_of "$LOGS/compose-$mode.log" 40; return 1; }
  local published
  published=$(docker ps --filter label=com.docker.compose.project=alignfl --format '{{.Ports}}' | tr ',' '\n' | grep -- '->' | sort -u | xargs)
  NOTE="$(compose ps -q | wc -l) containers; $NODES SuperNodes online; published: $published"
  case "$published" in *0.0.0.0*|*:::*) NOTE="$NOTE; a port is published beyond 127.0.0.1"; return 1;; esac
}

down() {
  local mode=$1
  compose --limit 120 logs --no-color >"$LOGS/compose-$mode.log" 2>&1  # every service's log, for the record
  compose --limit 300 down -v --remove-orphans --timeout 20 >"$LOGS/down-$mode.log" 2>&1 \
    || { tail_of "$LOGS/down-$mode.log"; NOTE="compose down failed"; return 1; }
  local left
  left=$(project_leftovers)
  [ -z "$left" ] || { NOTE="left after down -v: $left"; return 1; }
  NOTE="no container, network or volume of project alignfl left"
  return 0
}

project_leftovers() {
  local filter=label=com.docker.compose.project=alignfl
  {
    docker ps -aq --filter "$filter" | sed 's/^/container:/'
    docker network ls -q --filter "$filter" | sed 's/^/network:/'
    docker volume ls -q --filter "$filter" | sed 's/^/volume:/'
  } 2>/dev/null | xargs
}

run_config() {  # NAME MIN_NODES [ROUNDS]: the run config of every run here (the same but for these)
  echo "dataset=\"digits\" model=\"mlp\" num-server-rounds=${3:-$ROUNDS} seed=$SEED min-available-nodes=$2 run-name=\"$1\""
}

RUN_ID="" RUN_STATUS="" RUN_DETAILS=""
submit() {  # NAME MIN_NODES [ROUNDS]: submit the run, stream its log to a file in the background
  local reply
  RUN_ID="" RUN_STATUS="" RUN_DETAILS=""
  reply=$(cd "$ROOT" && timeout --foreground 300 flwr run . alignfl-docker --format json --run-config "$(run_config "$1" "$2" "${3:-}")" 2>&1)
  RUN_ID=$(py "$reply" 2>/dev/null <<'EOF'
import json, sys
reply = json.loads(sys.argv[1])
print(reply["run-id"] if reply.get("success") else "")
EOF
)
  [ -n "$RUN_ID" ] || { NOTE="flwr run failed: $(echo "$reply" | tail -n 3 | tr '\n' ' ' | cut -c1-300)"; return 1; }
  timeout --foreground "$RUN_TIMEOUT_S" flwr log "$RUN_ID" --stream >"$LOGS/run-$1.log" 2>&1 &
  BG_PIDS+=($!)
  log "run $1 submitted: run id $RUN_ID (log: $LOGS/run-$1.log)"
}

run_finished() {
  local listing
  listing=$(timeout --foreground 60 flwr ls --run-id "$RUN_ID" --format json 2>/dev/null) || return 1
  read -r RUN_STATUS RUN_DETAILS < <(py "$listing" <<'EOF' 2>/dev/null
import json, sys
run = json.loads(sys.argv[1])["runs"][0]
print(run["status"], run.get("status-details", "").replace("\n", " ")[:200])
EOF
)
  [[ "$RUN_STATUS" == finished* ]]
}

# wait_run NAME: until the run is finished (RUN_TIMEOUT_S at most: a hung run is stopped and fails the step)
wait_run() {
  if ! wait_for "$RUN_TIMEOUT_S" "run $RUN_ID to finish" run_finished; then
    NOTE="HUNG: run $1 ($RUN_ID) not finished after ${RUN_TIMEOUT_S} s (last status: ${RUN_STATUS:-?}); stopped with flwr stop"
    timeout --foreground 60 flwr stop "$RUN_ID" >>"$LOGS/run-$1.log" 2>&1
    return 1
  fi
  [ "$RUN_STATUS" = finished:completed ] \
    || { tail_of "$LOGS/run-$1.log"; NOTE="run $1 ended $RUN_STATUS: $RUN_DETAILS"; return 1; }
}

# metric FOLDER PYTHON-EXPRESSION: evaluated over summary (summary.json) and rows (metrics.jsonl's lines)
metric() {
  py "$1" "$2" <<'EOF'
import json, sys
from pathlib import Path
folder = Path(sys.argv[1])
summary = json.loads((folder / "summary.json").read_text())
rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
print(eval(sys.argv[2]))
EOF
}

complete_rows() {  # how many complete lines metrics.jsonl has
  local file=$1/metrics.jsonl
  [ -f "$file" ] && tr -cd '\n' <"$file" | wc -c || echo 0
}

# --- 5.-7. plain stack ---

PLAIN_ACCURACY=""
step_plain_up() { compose_env; COMPOSE_FILES=(-f "$ROOT/docker-compose.yml"); up plain; }

step_plain_run() {
  local name=compose-plain
  submit "$name" "$NODES" && wait_run "$name" || return 1
  local folder=$ALIGNFL_RESULTS/$name
  [ -f "$folder/summary.json" ] || { NOTE="completed, but no $folder/summary.json"; return 1; }
  PLAIN_ACCURACY=$(metric "$folder" 'summary["final-accuracy"]')
  local rounds trained
  rounds=$(metric "$folder" '[row["round"] for row in rows]')
  trained=$(metric "$folder" '[row.get("clients-trained") for row in rows[1:]]')
  [ "$rounds" = "$(py "$ROUNDS" <<<'import sys; print(list(range(int(sys.argv[1]) + 1)))')" ] \
    || { NOTE="rounds in metrics.jsonl: $rounds"; return 1; }
  NOTE="run $RUN_ID completed; rounds $rounds, clients trained per round $trained; final accuracy $PLAIN_ACCURACY"
  return 0
}

step_kill_supernode() {
  local name=compose-kill folder=$ALIGNFL_RESULTS/compose-kill
  submit "$name" "$KILL_MIN_NODES" "$KILL_ROUNDS" || return 1
  wait_for "$RUN_TIMEOUT_S" "round 1's metrics" eval '[ "$(complete_rows "$folder")" -ge 2 ] || run_finished' || return 1
  [ "$(complete_rows "$folder")" -ge 2 ] && ! [[ "$RUN_STATUS" == finished* ]] \
    || { NOTE="the run ended before round 1 was recorded ($RUN_STATUS)"; return 1; }
  log "round 1 recorded: SIGKILL supernode-2 and superexec-clientapp-2"
  compose kill -s SIGKILL supernode-2 superexec-clientapp-2 >>"$LOGS/kill.log" 2>&1 \
    || { tail_of "$LOGS/kill.log"; NOTE="docker compose kill failed"; return 1; }
  local killed_at=$SECONDS
  wait_run "$name" || { NOTE="$NOTE (min-available-nodes=$KILL_MIN_NODES)"; return 1; }
  local after=$((SECONDS - killed_at)) trained
  trained=$(metric "$folder" '[row.get("clients-trained") for row in rows[1:]]')
  [ "$trained" = "$(py "$NODES" "$KILL_ROUNDS" <<<'import sys; n, r = map(int, sys.argv[1:]); print([n] + [n - 1] * (r - 1))')" ] \
    || { NOTE="clients trained per round $trained: expected $NODES in round 1, $((NODES - 1)) in rounds 2-$KILL_ROUNDS"; return 1; }
  NOTE="node 2 killed after round 1; run $RUN_ID ($KILL_ROUNDS rounds, min-available-nodes=$KILL_MIN_NODES) completed ${after} s later; clients trained per round $trained; round 2 dropped: $(metric "$folder" 'str(rows[2].get("clients-dropped-reasons"))[:100]')"
  return 0
}

step_plain_down() { down plain; }

step_loopback() {
  local name=loopback-plain results=$WORK/results-loopback
  log "./scripts/deploy.sh (log: $LOGS/deploy-loopback.log)"
  timeout --foreground $((RUN_TIMEOUT_S + 300)) ./scripts/deploy.sh --num-supernodes "$NODES" --work-dir "$WORK/loopback" \
    --run-config "$(run_config "$name" "$NODES") results-dir=\"$results\"" >"$LOGS/deploy-loopback.log" 2>&1 \
    || { tail_of "$LOGS/deploy-loopback.log"; NOTE="deploy.sh failed (log: $LOGS/deploy-loopback.log)"; return 1; }
  local loopback diff
  loopback=$(metric "$results/$name" 'summary["final-accuracy"]')
  diff=$(py "$PLAIN_ACCURACY" "$loopback" <<<'import sys; print(f"{abs(float(sys.argv[1]) - float(sys.argv[2])):.4f}")')
  NOTE="final accuracy: compose $PLAIN_ACCURACY, loopback $loopback (|diff| $diff, accepted up to $COMPARE_TOL)"
  py "$diff" "$COMPARE_TOL" <<<'import sys; sys.exit(float(sys.argv[1]) > float(sys.argv[2]))'
}

# --- 8. TLS + SuperNode authentication ---

step_tls_up() {
  compose_env
  bash scripts/make_certs.sh "$ALIGNFL_CERTS" $((NODES + 1)) >"$LOGS/make_certs.log" 2>&1 \
    || { tail_of "$LOGS/make_certs.log"; NOTE="make_certs.sh failed"; return 1; }
  chown -R 49999:49999 "$ALIGNFL_CERTS"   # the containers' user reads the keys
  COMPOSE_FILES=(-f "$ROOT/docker-compose.yml" -f "$ROOT/compose.tls.yml")
  up tls || return 1
  local registered
  registered=$(docker logs "$(compose ps -aq supernode-register)" 2>&1 | grep -o 'registered [0-9]* SuperNode key(s)')
  NOTE="$NOTE; supernode-register: ${registered:-?}; key of node $NODES made but not registered"
  return 0
}

step_tls_unregistered() {
  local node=$NODES certs=/app/certs/supernode-$NODES
  # a SuperNode with make_certs.sh's key for node 3, which supernode-register did not register
  compose --limit 300 run --rm --no-deps -T -v "$ALIGNFL_CERTS/supernode-$node:$certs:ro" supernode-0 \
    --superlink superlink:$PORT --isolation process --host 127.0.0.1 --port 9094 \
    --node-config "partition-id=0 num-partitions=$NODES" --root-certificates /app/certs/ca.crt \
    --auth-supernode-private-key "$certs/auth" --ssl-ca-certfile /app/certs/ca.crt \
    --ssl-certfile "$certs/runtime.crt" --ssl-keyfile "$certs/runtime.key" >"$LOGS/unregistered.log" 2>&1
  local rc=$?
  [ $rc = 124 ] && { NOTE="the unregistered SuperNode was still running after 300 s"; return 1; }
  [ $rc != 0 ] || { NOTE="the unregistered SuperNode exited 0"; return 1; }
  # code 2004 (FLEET_NODE_ACTIVATION_FAILED) is the SuperLink's answer to a key it has no SuperNode for: the
  # node reached the SuperLink over TLS and was refused (a connection problem has other codes)
  grep -q "\[code: 2004\] Failed to activate SuperNode" "$LOGS/unregistered.log" \
    || { tail_of "$LOGS/unregistered.log"; NOTE="exit $rc without '[code: 2004] Failed to activate SuperNode'"; return 1; }
  local online; online=$(online_supernodes)
  [ "$online" = "$NODES" ] || { NOTE="$online SuperNodes online, expected $NODES"; return 1; }
  NOTE="refused by the SuperLink: exit $rc, '$(grep -m1 -o '\[code: 2004\] Failed to activate SuperNode.*' "$LOGS/unregistered.log" | cut -c1-80)'; still $online online"
  return 0
}

step_tls_run() {
  local name=compose-tls
  submit "$name" "$NODES" && wait_run "$name" || return 1
  local accuracy; accuracy=$(metric "$ALIGNFL_RESULTS/$name" 'summary["final-accuracy"]') \
    || { NOTE="completed, but no summary"; return 1; }
  NOTE="run $RUN_ID completed over TLS; final accuracy $accuracy (plain stack: $PLAIN_ACCURACY)"
  return 0
}

step_tls_down() { down tls; }

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
  local pid
  for pid in "${BG_PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  if [ -n "$CURRENT_STEP" ]; then  # the step that was running when the check was interrupted or ended
    record "$CURRENT_STEP" $((SECONDS - CURRENT_START)) FAIL "did not finish (exit status $rc$([ $rc = 130 ] && echo ': interrupted'))"
    FAILED=1
  fi
  if docker info >/dev/null 2>&1 && [ -n "$(project_leftovers)" ]; then
    local start=$SECONDS
    log "cleanup: docker compose down -v"
    COMPOSE_FILES=(-f "$ROOT/docker-compose.yml" -f "$ROOT/compose.tls.yml")  # every service of both stacks
    compose --limit 300 down -v --remove-orphans --timeout 10 >"$LOGS/down-cleanup.log" 2>&1
    local left; left=$(project_leftovers)
    if [ -n "$left" ]; then
      record "cleanup: down -v" $((SECONDS - start)) FAIL "left: $left"; FAILED=1
    else
      record "cleanup: down -v" $((SECONDS - start)) PASS "stacks removed after an early end"
    fi
  fi
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

wanted() {  # a step group not named in SKIP (skipped ones are listed in the report)
  case " $SKIP " in *" $1 "*) FACTS+=("skipped (SKIP): $1"); return 1;; esac
}

[ "$(id -u)" = 0 ] || { echo "compose_check.sh: run as root (it installs packages and starts dockerd)" >&2; exit 2; }
log "work folder: $WORK"
step critical "tools (docker engine, compose v2, buildx, .venv)" step_tools
step critical "docker daemon" step_daemon
step critical "base image (FLWR_IMAGE)" step_base_image
step critical "project image (Dockerfile)" step_image
step critical "plain stack: up, $NODES SuperNodes online" step_plain_up
step check "plain stack: run, $ROUNDS rounds on digits (MLP), seed $SEED" step_plain_run
wanted kill && step check "plain stack: SuperNode killed after round 1 of $KILL_ROUNDS, run still completes" step_kill_supernode
step critical "plain stack: down -v" step_plain_down
wanted loopback && step check "loopback ./scripts/deploy.sh, same seed and run config: accuracy compared" step_loopback
if wanted tls; then
  step critical "TLS + SuperNode auth stack: up, $NODES SuperNodes online" step_tls_up
  step check "TLS stack: SuperNode with an unregistered key is refused" step_tls_unregistered
  step check "TLS stack: run, $ROUNDS rounds" step_tls_run
  step critical "TLS stack: down -v" step_tls_down
fi
