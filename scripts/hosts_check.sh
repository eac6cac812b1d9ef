#!/usr/bin/env bash
# The deployment across three "hosts" on this machine (as root; not in CI): three network namespaces made here,
# one for the SuperLink and one per SuperNode machine, joined by veth pairs to a bridge inside the SuperLink's
# namespace, with addresses from 10.231.7.0/24, used only inside these namespaces. Each host runs its role of
# `python -m fl_app.deploy` (scripts/deploy.sh): the SuperLink side listens on 10.231.7.1 only (never on
# loopback), with TLS for that address and the name fl-link, and SuperNode authentication; the node hosts dial
# it by address (host A) and by name (host B, through the namespace's /etc/hosts). Then:
#   1. the run goes on when host B's link is cut mid-run (`ip link set … down`): B's messages are dropped with
#      Flower's reason (the node failed to report a heartbeat: unreachable), within the SuperLink's bounded wait;
#   2. the link comes back and B trains again in a round sampled after that, within RETURN_WAIT_S seconds
#      (Flower 1.42's SuperNode retries its heartbeat and requests at most 20 s apart); the run has ROUNDS rounds
#      so that rounds go on for longer than that: where the rounds left, at the pace seen so far, cannot fill it,
#      the check says so and fails, as it fails (with the timing) when B does not train again in time or the
#      run ends first;
#   3. the run completes;
#   4. a SuperNode that dials a name the SuperLink's certificate does not name stops at once, saying so.
# At the end every process it started is stopped by process id, and every namespace, link and hosts file it
# made is deleted (also on failure or Ctrl-C). The report: <work>/report.md.
#
#   sudo scripts/hosts_check.sh [--work-dir DIR]
# Environment: ROUNDS (40: rounds of the run), RETURN_WAIT_S (90: how long B may take to train again once its
# link is back), PYTHON (the project's .venv).
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
ROUNDS=${ROUNDS:-40}
RETURN_WAIT_S=${RETURN_WAIT_S:-90}
TAG=afl$$                      # names of this run's namespaces and links (at most 15 characters)
NS_LINK=$TAG-link NS_A=$TAG-a NS_B=$TAG-b
NET=10.231.7 LINK_IP=10.231.7.1 A_IP=10.231.7.2 B_IP=10.231.7.3 PORT=9093
PIDS=()
[ -d /etc/netns ] && NETNS_ETC_EXISTED=1 || NETNS_ETC_EXISTED=0
log() { echo "[hosts_check] $*" | tee -a "$WORK/report.md"; }

cleanup() {
  local status=$?
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
      ip netns del "$ns"
    fi
    rm -rf "/etc/netns/$ns"
  done
  [ "$NETNS_ETC_EXISTED" = 1 ] || rmdir /etc/netns 2>/dev/null || true
  exit $status
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

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
# start NAME NS COMMAND...: in the background, its output in WORK/NAME.log; the command's own process id (which
# `ip netns exec` may run as a child of its own) into PIDS, and the waitable one into WAIT_PID
start() {
  local name=$1 ns=$2; shift 2
  rm -f "$WORK/$name.pid"
  in_ns "$ns" sh -c 'echo $$ > "$0"; exec "$@"' "$WORK/$name.pid" "$@" > "$WORK/$name.log" 2>&1 &
  WAIT_PID=$!
  for _ in $(seq 600); do [ -s "$WORK/$name.pid" ] && break; sleep 0.1; done
  PIDS+=("$(cat "$WORK/$name.pid")" "$WAIT_PID")
}
RESULTS=$WORK/results
start link "$NS_LINK" "$PY" -m fl_app.deploy superlink --host "$LINK_IP" --address "$LINK_IP" --address fl-link \
  --num-supernodes 2 --tls --certs "$WORK/link/certs" --work-dir "$WORK/link" --rounds "$ROUNDS" \
  --run-config "dataset=\"digits\" model=\"small-mlp\" results-dir=\"$RESULTS\" run-name=\"hosts\" round-timeout=300.0"
LINK_PID=$WAIT_PID
start host-a "$NS_A" "$PY" -m fl_app.deploy supernodes --superlink "$LINK_IP:$PORT" --nodes 0 --num-supernodes 2 \
  --tls --certs "$WORK/host-a/certs" --work-dir "$WORK/host-a"

# Wait for the SuperLink before node B's pre-check (node A's SuperNode retries by itself).
"$PY" - "$NS_LINK" "$LINK_IP" "$PORT" <<'EOF'
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
log "the SuperLink listens on $LINK_IP:$PORT only (not on loopback)"
start host-b "$NS_B" "$PY" -m fl_app.deploy supernodes --superlink "fl-link:$PORT" --nodes 1 --num-supernodes 2 \
  --tls --certs "$WORK/host-b/certs" --work-dir "$WORK/host-b"

# 4. A SuperNode dialling a name its certificate lacks stops at once (host A, while the run goes on).
start=$(date +%s)
set +e
in_ns "$NS_A" "$PY" -m fl_app.deploy supernodes --superlink "wrong-name:$PORT" --nodes 0 --num-supernodes 2 --tls \
  --certs "$WORK/host-a/certs" --work-dir "$WORK/host-a-wrong" > "$WORK/wrong-name.log" 2>&1
code=$?
set -e
took=$(( $(date +%s) - start ))
# "At once": the time is Python's start-up (imports) plus one TLS handshake, never a retry loop.
grep -q "not valid for 'wrong-name'" "$WORK/wrong-name.log" && [ "$code" = 1 ] && [ "$took" -lt 300 ] || {
  log "FAILED: the SuperNode dialling wrong-name exited $code after $took s:"; cat "$WORK/wrong-name.log"; exit 1; }
log "a SuperNode dialling wrong-name:$PORT stopped after $took s (load $(cut -d' ' -f1 /proc/loadavg)) with exit code $code: $(grep -o 'SuperNodes not started.*' "$WORK/wrong-name.log")"

# 1.-3. Cut host B's link after round 2, restore it once B's messages were dropped, wait (bounded) for B to train
# in a round sampled after that, then for the run's end.
"$PY" - "$RESULTS/hosts/metrics.jsonl" "$NS_B" "$TAG"b "$LINK_PID" "$WORK/report.md" "$ROUNDS" "$RETURN_WAIT_S" <<'EOF'
import json, os, statistics, subprocess, sys, time
from pathlib import Path
metrics, ns, link, link_pid, report = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
rounds, return_wait = int(sys.argv[6]), float(sys.argv[7])

def note(text):
    print(f"[hosts_check] {text}", flush=True)
    with open(report, "a") as stream:
        stream.write(f"[hosts_check] {text}\n")

def rows():
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []

def wait(condition, what, timeout=1800):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        try:
            os.kill(link_pid, 0)
        except ProcessLookupError:
            if not condition():
                sys.exit(f"FAILED: the SuperLink side ended before {what}")
        time.sleep(0.5)
    return True

if not wait(lambda: any(row["round"] == 2 for row in rows()), "round 2"):
    sys.exit("FAILED: no round 2 within 1800 s")
subprocess.run(["ip", "-n", ns, "link", "set", link, "down"], check=True)
cut = time.monotonic()
note(f"host B's link cut after round 2 (ip -n {ns} link set {link} down)")
dropped = lambda: [row for row in rows() if row["round"] > 2 and row.get("clients-dropped-reasons", {}).get("1")]
if not wait(lambda: dropped(), "host B's messages to be dropped"):
    sys.exit("FAILED: host B's messages were not dropped within 1800 s of the cut")
row = dropped()[0]
note(f"round {row['round']}: node 1 dropped {time.monotonic() - cut:.0f} s after the cut: "
     f"{row['clients-dropped-reasons']['1']!r}; clients trained {row['clients-trained']}")
subprocess.run(["ip", "-n", ns, "link", "set", link, "up"], check=True)
restored = time.monotonic()
seen = rows()
back = max(r["round"] for r in seen)
# A round that B trains in was sampled after its link came back: a round in flight now sampled node A only (the
# SuperLink had marked B offline), so any round after `back` in which both nodes trained counts.
times = [b["elapsed-s"] - a["elapsed-s"] for a, b in zip(seen[1:], seen[2:]) if not b.get("clients-dropped")]
typical = statistics.median(times) if times else float("nan")
left = rounds - back
note(f"host B's link restored after round {back}; {left} rounds left, a round takes ~{typical:.1f} s "
     f"(median of the rounds without drops), B has {return_wait:.0f} s (RETURN_WAIT_S) to train again")
if not left * typical > return_wait:
    sys.exit(f"FAILED: {left} rounds of ~{typical:.1f} s ({left * typical:.0f} s) cannot cover RETURN_WAIT_S="
             f"{return_wait:.0f} s after the link came back: the check could not tell a node that never returns "
             "from a run that ended first; raise ROUNDS")
again = lambda: next((r for r in rows() if r["round"] > back and r["clients-trained"] == 2), None)
ended = lambda: any(r["round"] == rounds for r in rows())
wait(lambda: again() is not None or ended(), "host B to train again", timeout=return_wait)
took = time.monotonic() - restored
row = again()
trained = ", ".join(f"{r['round']}:{r.get('clients-trained', '-')}" for r in rows()[1:])
if row is None:
    last = max(r["round"] for r in rows())
    why = "the run ended first" if ended() else f"RETURN_WAIT_S={return_wait:.0f} s ran out"
    sys.exit(f"FAILED: host B did not train again in rounds {back + 1}-{last}, {took:.0f} s after its link came "
             f"back ({why}); clients trained per round: {trained}")
note(f"round {row['round']}: both nodes trained again, written {took:.0f} s after the link came back "
     f"({row['round'] - back} rounds later, {rounds - row['round']} rounds still to go)")
note("clients trained per round so far: " + trained)
EOF
set +e
wait "$LINK_PID"
code=$?
set -e
[ "$code" = 0 ] || { log "FAILED: the SuperLink side exited with $code:"; tail -30 "$WORK/link.log"; exit 1; }
log "run completed: $(grep -o 'final accuracy.*' "$WORK/link.log" | tail -1)"
log "GREEN"
