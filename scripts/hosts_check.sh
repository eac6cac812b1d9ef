#!/usr/bin/env bash
# The deployment across three "hosts" on this machine (as root; not in CI): three network namespaces made here,
# one for the SuperLink and one per SuperNode machine, joined by veth pairs to a bridge inside the SuperLink's
# namespace, with addresses from 10.231.7.0/24, used only inside these namespaces. Each host runs its role of
# `python -m alignfl.fl_app.deploy` (scripts/deploy.sh): the SuperLink side listens on 10.231.7.1 only (never on
# loopback), with TLS for that address and the name fl-link, and SuperNode authentication; the node hosts dial
# it by address (host A) and by name (host B, through the namespace's /etc/hosts). The SuperLink side serves
# (--serve) and this script submits two runs to it from the SuperLink's namespace. Then:
#   1. the first run goes on when host B's link is cut mid-run (`ip link set … down`): B's messages are dropped
#      with Flower's reason (the node failed to report a heartbeat: unreachable), within the SuperLink's bounded
#      wait;
#   2. the link comes back and B trains again: the second run waits in its first round for both nodes
#      (min-available-nodes=2, for as long as it takes, up to node-wait-timeout=NODE_WAIT_S) and B must train in
#      it; the output says how long B took to come back and how long the run waited for it. Whether B also
#      trained again in the first run, before its rounds ran out, is reported but not judged: that depends on
#      the machine's pace, the second run does not;
#   3. both runs complete;
#   4. a SuperNode that dials a name the SuperLink's certificate does not name stops at once, saying so.
# At the end every process it started is stopped by process id, and every namespace, link and hosts file it
# made is deleted, however it ends: failure, Ctrl-C, SIGTERM (e.g. from `timeout`) or SIGHUP. The report:
# <work>/report.md.
#
#   sudo scripts/hosts_check.sh [--work-dir DIR]
# Environment: ROUNDS (8: rounds of the first run), NODE_WAIT_S (1800: the most the second run waits for B),
# PYTHON (the project's .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
. scripts/check_options.sh
parse_check_options "$0" "$@"
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ "$(id -u)" = 0 ] || { echo "hosts_check.sh: run as root (it makes network namespaces)" >&2; exit 2; }
command -v ip >/dev/null || { echo "hosts_check.sh: 'ip' (iproute2) is required" >&2; exit 2; }
WORK=$(realpath -m "${WORK:-$(mktemp -d /tmp/alignfl-hosts-XXXXXX)}")
mkdir -p "$WORK"
ROUNDS=${ROUNDS:-8}
NODE_WAIT_S=${NODE_WAIT_S:-1800}
TAG=afl$$                      # names of this run's namespaces and links (at most 15 characters)
NS_LINK=$TAG-link NS_A=$TAG-a NS_B=$TAG-b
NET=10.231.7 LINK_IP=10.231.7.1 A_IP=10.231.7.2 B_IP=10.231.7.3 PORT=9093
PIDS=()                        # every process started here (roles, runs, watchers), stopped by cleanup
CLEANED=0
[ -d /etc/netns ] && NETNS_ETC_EXISTED=1 || NETNS_ETC_EXISTED=0
log() { echo "[hosts_check] $*" | tee -a "$WORK/report.md"; }

cleanup() {
  local status=$?
  # `timeout` signals this script and then its process group, so a second TERM can come while this runs: from
  # here on stop signals are ignored, and a second call does nothing.
  trap '' INT TERM HUP
  [ "$CLEANED" = 0 ] || return 0
  CLEANED=1
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 1200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done  # it stops its services first
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  for ns in "$NS_LINK" "$NS_A" "$NS_B"; do
    if ip netns list | grep -qw "$ns"; then
      left=$(ip netns pids "$ns" | tr '\n' ' ' || true)
      [ -z "$left" ] || { echo "[hosts_check] FAILED: processes left in $ns: $left; stopping them" >&2; kill -KILL $left || true
                          status=1; }
      ip netns del "$ns" || status=1
    fi
    rm -rf "/etc/netns/$ns"
  done
  [ "$NETNS_ETC_EXISTED" = 1 ] || rmdir /etc/netns 2>/dev/null || true
  exit $status
}
trap cleanup EXIT
trap "trap '' INT TERM HUP; exit 130" INT   # any later stop signal is ignored: it cannot cut cleanup short
trap "trap '' INT TERM HUP; exit 143" TERM
trap "trap '' INT TERM HUP; exit 129" HUP

: > "$WORK/report.md"
log "work folder $WORK; namespaces $NS_LINK (SuperLink, $LINK_IP), $NS_A (node 0, $A_IP), $NS_B (node 1, $B_IP)"
for ns in "$NS_LINK" "$NS_A" "$NS_B"; do ip netns add "$ns"; ip -n "$ns" link set lo up; done
ip -n "$NS_LINK" link add br0 type bridge
ip -n "$NS_LINK" addr add "$LINK_IP/24" dev br0
ip -n "$NS_LINK" link set br0 up
for host in a b; do
  ns=$TAG-$host ip=$([ $host = a ] && echo "$A_IP" || echo "$B_IP")
  ip link add "$TAG$host" netns "$ns" type veth peer name "$TAG$host-l" netns "$NS_LINK"
  ip -n "$ns" addr add "$ip/24" dev "$TAG$host"
  ip -n "$ns" link set "$TAG$host" up
  ip -n "$NS_LINK" link set "$TAG$host-l" master br0 up
  mkdir -p "/etc/netns/$ns"      # `ip netns exec` shows this as the host's /etc/hosts
  printf '127.0.0.1 localhost\n%s fl-link\n%s wrong-name\n' "$LINK_IP" "$LINK_IP" > "/etc/netns/$ns/hosts"
done

# The SuperLink host makes the CA, its certificate for the names the nodes dial and every node's key pair;
# each node host gets only the CA and its own node's files.
SUPERLINK_SANS="IP:$LINK_IP,DNS:fl-link" bash scripts/make_certs.sh "$WORK/link/certs" 2 >/dev/null
for node in 0 1; do
  host=$([ $node = 0 ] && echo a || echo b)
  mkdir -p "$WORK/host-$host/certs"
  cp "$WORK/link/certs/ca.crt" "$WORK/host-$host/certs/"
  cp -r "$WORK/link/certs/supernode-$node" "$WORK/host-$host/certs/"
done

in_ns() { local ns=$1; shift; ip netns exec "$ns" env HOME="$WORK/home-$ns" FLWR_TELEMETRY_ENABLED=0 "$@"; }
declare -A INNER=()            # waitable pid → the command's own pid (see start)
# start NAME NS COMMAND...: in the background, its output in WORK/NAME.log; the command's own process id (which
# `ip netns exec` may run as a child of its own) and the waitable one (WAIT_PID) into PIDS
start() {
  local name=$1 ns=$2; shift 2
  rm -f "$WORK/$name.pid"
  in_ns "$ns" sh -c 'echo $$ > "$0"; exec "$@"' "$WORK/$name.pid" "$@" > "$WORK/$name.log" 2>&1 &
  WAIT_PID=$!
  PIDS+=("$WAIT_PID")
  for _ in $(seq 600); do [ -s "$WORK/$name.pid" ] && break; sleep 0.1; done
  INNER[$WAIT_PID]=$(cat "$WORK/$name.pid")
  PIDS+=("${INNER[$WAIT_PID]}")
}
# finish PID: wait for a background command (a stop signal interrupts `wait` at once, where a command in the
# foreground would delay the trap until it ends); its exit code in CODE. Its pids leave PIDS: cleanup must not
# signal a process that has since got one of them.
finish() {
  CODE=0
  wait "$1" || CODE=$?
  local gone=" $1 ${INNER[$1]:-} " kept=() pid
  for pid in "${PIDS[@]}"; do [[ $gone == *" $pid "* ]] || kept+=("$pid"); done
  PIDS=("${kept[@]}")
}
RESULTS=$WORK/results
# One experiment submitted to the serving SuperLink side from its namespace through its `flwr` CLI home, as
# `python -m alignfl.fl_app.deploy superlink` submits its own (validated first; stops what it started on a stop signal);
# exits as the launcher does: 0 only for a completed run whose summary was written.
SUBMIT='
import sys
from pathlib import Path
from alignfl.fl_app.runtime.flwr_cli import CONNECTION, parse_overrides, submit_and_follow
from alignfl.fl_app.runtime.launch import prepare_config, report_outcome
from alignfl.fl_app.runtime.processes import Stopped, stop_signals
from alignfl.fl_app.runtime.superlink import flower_environment
link_work, results, name, rounds, extra = sys.argv[1:]
values = {"dataset": "digits", "model": "small-mlp", "results-dir": results, "run-name": name,
          "num-server-rounds": int(rounds), "fraction-train": 1.0, "round-timeout": 300.0, **parse_overrides(extra)}
try:
    with stop_signals():
        config = prepare_config(values, 2)
        cli = flower_environment(Path(link_work) / "homes" / "cli")
        status, details = submit_and_follow(config.to_run_config(), cli, [CONNECTION])
except Stopped as stop:
    sys.exit(stop.exit_code)
sys.exit(report_outcome(config, status, details))
'
# submit NAME ROUNDS 'key=value ...': one run in the background (its log WORK/NAME.log), WAIT_PID to finish it
submit() { start "$1" "$NS_LINK" "$PY" -c "$SUBMIT" "$WORK/link" "$RESULTS" "$1" "$2" "$3"; }

start link "$NS_LINK" "$PY" -m alignfl.fl_app.deploy superlink --host "$LINK_IP" --address "$LINK_IP" --address fl-link \
  --num-supernodes 2 --tls --certs "$WORK/link/certs" --work-dir "$WORK/link" --serve
LINK_PID=$WAIT_PID
start host-a "$NS_A" "$PY" -m alignfl.fl_app.deploy supernodes --superlink "$LINK_IP:$PORT" --nodes 0 --num-supernodes 2 \
  --tls --certs "$WORK/host-a/certs" --work-dir "$WORK/host-a"

# Wait for the SuperLink before node B's pre-check (node A's SuperNode retries by itself).
"$PY" - "$NS_LINK" "$LINK_IP" "$PORT" <<'EOF' &
import subprocess, sys, time
ns, ip, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
want = "".join(f"{int(part):02X}" for part in reversed(ip.split("."))) + f":{port:04X}"
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    table = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/tcp", "/proc/net/tcp6"],
                           capture_output=True, text=True).stdout.splitlines()
    listening = [line.split()[1] for line in table[1:] if len(line.split()) > 3 and line.split()[3] == "0A"]
    if any(address.endswith(f":{port:04X}") for address in listening):
        assert want in listening, f"the SuperLink listens on {listening}, not only on {ip}:{port}"
        print(f"[hosts_check] the SuperLink listens on {ip}:{port} only (its namespace's listening sockets: {listening})")
        sys.exit(0)
    time.sleep(1)
sys.exit("the SuperLink did not listen within 600 s")
EOF
PIDS+=($!)
finish $!
[ "$CODE" = 0 ] || { log "FAILED: the SuperLink did not listen on $LINK_IP:$PORT only"; exit 1; }
log "the SuperLink listens on $LINK_IP:$PORT only (not on loopback)"
start host-b "$NS_B" "$PY" -m alignfl.fl_app.deploy supernodes --superlink "fl-link:$PORT" --nodes 1 --num-supernodes 2 \
  --tls --certs "$WORK/host-b/certs" --work-dir "$WORK/host-b"

# 4. A SuperNode dialling a name its certificate lacks stops at once (host A).
began=$(date +%s)
start wrong-name "$NS_A" "$PY" -m alignfl.fl_app.deploy supernodes --superlink "wrong-name:$PORT" --nodes 0 \
  --num-supernodes 2 --tls --certs "$WORK/host-a/certs" --work-dir "$WORK/host-a-wrong"
finish "$WAIT_PID"
took=$(( $(date +%s) - began ))
# "At once": the time is Python's start-up (imports) plus one TLS handshake, never a retry loop.
grep -q "not valid for 'wrong-name'" "$WORK/wrong-name.log" && [ "$CODE" = 1 ] && [ "$took" -lt 300 ] || {
  log "FAILED: the SuperNode dialling wrong-name exited $CODE after $took s:"; cat "$WORK/wrong-name.log"; exit 1; }
log "a SuperNode dialling wrong-name:$PORT stopped after $took s (load $(cut -d' ' -f1 /proc/loadavg)) with exit code $CODE: $(grep -o 'SuperNodes not started.*' "$WORK/wrong-name.log")"

# 1.-3. The first run: cut host B's link after round 2, restore it once B's messages were dropped, note whether B
# trains again before the run's rounds run out; then the second run, which waits for both nodes.
submit hosts "$ROUNDS" ""
FIRST_PID=$WAIT_PID
"$PY" - "$RESULTS/hosts/metrics.jsonl" "$NS_B" "$TAG"b "$FIRST_PID" "$WORK/report.md" "$ROUNDS" "$WORK/restored" <<'EOF' &
import json, subprocess, sys, time
from pathlib import Path
metrics, ns, link, run_pid, report = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
rounds, restored_file = int(sys.argv[6]), Path(sys.argv[7])

def note(text):
    print(f"[hosts_check] {text}", flush=True)
    with open(report, "a") as stream:
        stream.write(f"[hosts_check] {text}\n")

def rows():
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []

def running():  # an ended run stays a zombie until the script waits for it
    try:
        return Path(f"/proc/{run_pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

def wait(condition, what):
    while not condition():
        if not running() and not condition():
            note(f"FAILED: the first run ended before {what}")
            sys.exit(1)
        time.sleep(0.5)

wait(lambda: any(row["round"] == 2 for row in rows()), "round 2")
subprocess.run(["ip", "-n", ns, "link", "set", link, "down"], check=True)
cut = time.monotonic()
note(f"host B's link cut after round 2 (ip -n {ns} link set {link} down)")
dropped = lambda: [row for row in rows() if row["round"] > 2 and row.get("clients-dropped-reasons", {}).get("1")]
wait(lambda: dropped(), "host B's messages were dropped")
row = dropped()[0]
note(f"round {row['round']}: node 1 dropped {time.monotonic() - cut:.0f} s after the cut: "
     f"{row['clients-dropped-reasons']['1']!r}; clients trained {row['clients-trained']}")
subprocess.run(["ip", "-n", ns, "link", "set", link, "up"], check=True)
restored_file.write_text(f"{time.time()}\n")
restored = time.monotonic()
back = max(r["round"] for r in rows())
note(f"host B's link restored after round {back} of {rounds}")
again = lambda: next((r for r in rows() if r["round"] > back and r["clients-trained"] == 2), None)
while running() and again() is None:
    time.sleep(0.5)
row = again()
trained = ", ".join(f"{r['round']}:{r.get('clients-trained', '-')}" for r in rows()[1:])
if row is not None:
    note(f"first run, round {row['round']}: both nodes trained again, {time.monotonic() - restored:.0f} s after "
         f"the link came back ({row['round'] - back} rounds later)")
else:
    note(f"first run: its rounds ran out {time.monotonic() - restored:.0f} s after the link came back, before B "
         "trained again in it (not judged: the second run waits for B)")
note("first run, clients trained per round: " + trained)
EOF
PIDS+=($!)
finish $!
[ "$CODE" = 0 ] || { log "FAILED: the first run's watcher exited $CODE"; exit 1; }
finish "$FIRST_PID"
[ "$CODE" = 0 ] || { log "FAILED: the first run exited with $CODE:"; tail -30 "$WORK/hosts.log"; exit 1; }
log "first run completed: $(grep -o 'final accuracy.*' "$WORK/hosts.log" | tail -1)"

submit rejoin 2 "min-available-nodes=2 node-wait-timeout=$NODE_WAIT_S"
SECOND_PID=$WAIT_PID
"$PY" - "$RESULTS/rejoin/metrics.jsonl" "$WORK/rejoin.log" "$SECOND_PID" "$WORK/report.md" "$WORK/restored" \
  "$NODE_WAIT_S" <<'EOF' &
import json, sys, time
from pathlib import Path
metrics, log, run_pid, report, restored = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(Path(sys.argv[5]).read_text())
node_wait = float(sys.argv[6])
submitted = time.time()

def note(text):
    print(f"[hosts_check] {text}", flush=True)
    with open(report, "a") as stream:
        stream.write(f"[hosts_check] {text}\n")

def rows():
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []

def running():  # an ended run stays a zombie until the script waits for it
    try:
        return Path(f"/proc/{run_pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

began = None  # when round 0's row came: the run had waited for its nodes
while running() and not any(row["round"] == 1 for row in rows()):
    if began is None and rows():
        began = time.time()
    time.sleep(0.5)
began = began or time.time()
first = next((row for row in rows() if row["round"] == 1), None)
waits = log.read_text().count("waiting for nodes:") if log.exists() else 0
if first is None or first["clients-trained"] != 2:
    note(f"FAILED: host B did not train in the second run's round 1 (round 1: {first}; the run waits at most "
         f"node-wait-timeout={node_wait:.0f} s for both nodes)")
    sys.exit(1)
waited = f"waited about {began - submitted:.0f} s for both nodes (its log: 'waiting for nodes' x{waits})" if waits \
    else "found both nodes online at once"
note(f"second run, round 1: both nodes trained, host B among them; the run {waited}; its rounds began "
     f"{began - restored:.0f} s after B's link came back")
EOF
PIDS+=($!)
finish $!
[ "$CODE" = 0 ] || { log "FAILED: see $WORK/rejoin.log"; exit 1; }
finish "$SECOND_PID"
[ "$CODE" = 0 ] || { log "FAILED: the second run exited with $CODE:"; tail -30 "$WORK/rejoin.log"; exit 1; }
log "second run completed: $(grep -o 'final accuracy.*' "$WORK/rejoin.log" | tail -1)"
log "GREEN"
