#!/usr/bin/env bash
# Sweeps through a real SLURM cluster, end to end, on this one machine (root, Debian; not part of CI):
#   1. tools: Debian's slurm-wlm and munge where absent (apt-get); the project's .venv (scripts/setup.sh)
#   2. a one-node cluster in a work folder: a munge key, munged on its own socket, a slurm.conf naming this host
#      (own ports, state/spool/pid/log files in the work folder, no accounting, job completion log
#      jobcomp/filetxt), slurmctld and slurmd in the foreground of this script, stopped by their pids at the
#      end, also on failure and Ctrl-C
#   3. a 2 x 2 sweep (pan.mode=off,mul pan.a=0.1 seed=0,1 on digits) through hydra/launcher=slurm: each job ran
#      as a SLURM job (its SLURM job id in its job folder, its end state COMPLETED in SLURM's job completion log),
#      and its report equals the same sweep run locally (the basic launcher), figure for figure
#   4. a second sweep of which one job is cancelled with scancel while it RUNS (its log written) and one while it is
#      PENDING (where one is): SLURM's state of the running one is CANCELLED, the report names both as cancelled,
#      with their SLURM job ids and logs, and the others complete and count
#   5. one job with sim.backend=ray: Ray starts inside the SLURM job on the compute node (the job's output shows
#      flwr run using its private local SuperLink, and a Ray session appears in the temp folder the job was given),
#      the job COMPLETES, and Ray's processes end with it (that temp folder is checked in step 6)
#   6. nothing left behind: no SLURM job, no daemon, no process of the jobs (Ray's included), no spool or state
#      file
# Prints a report (steps, wall times, PASS/FAIL) and exits non-zero on any failure. However it ends (failure,
# Ctrl-C, SIGTERM e.g. from `timeout`, SIGHUP) it first cancels the cluster's jobs and waits for them to end,
# then stops the daemons by pid: they run in a session of their own (setsid), so a signal to this script's
# process group does not stop them before they could end the jobs. Every process it starts (daemons, sweeps,
# jobs) carries ALIGNFL_SLURM_CHECK=<work folder> in its environment, which is how leftovers are found.
#
#   scripts/slurm_check.sh [--work-dir DIR]
# Environment: ROUNDS (2: rounds per job), CLIENTS (4: clients per job), NICE (10), PYTHON (the project's .venv).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

. scripts/check_options.sh
parse_check_options "$0" "$@"
[ "$(id -u)" = 0 ] || { echo "slurm_check.sh: run it as root (it installs packages and starts SLURM's daemons)" >&2; exit 2; }

ROUNDS=${ROUNDS:-2}
CLIENTS=${CLIENTS:-4}
NICE=${NICE:-10}
WORK=${WORK:-$(mktemp -d /tmp/alignfl-slurm-XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
STARTED=$(date +%s)
RESULTS=()
FAILED=0
PIDS=()          # daemons this script started, in start order
CHILDREN=()      # the sweep (or other command) this script is waiting for
CLEANED=0
SELF_PGRP=$(sed 's/.*) //' /proc/$$/stat | cut -d' ' -f3)   # this script's process group (timeout's, under timeout)
export ALIGNFL_SLURM_CHECK=$WORK   # inherited by the daemons, the sweeps, sbatch's jobs and SLURM's step daemons
RAY_TMP=/tmp/afl-ray-$$   # step 5's Ray (its socket paths must stay short); step 6 looks for its processes

say() { echo "[slurm_check] $*"; }
record() {       # record STEP STATUS DETAIL
  RESULTS+=("$(printf '%-44s %-5s %s' "$1" "$2" "$3")")
  [ "$2" = PASS ] || FAILED=1
  say "$1: $2 $3"
}

# ours: the live processes carrying this run's ALIGNFL_SLURM_CHECK (the daemons, the jobs, their slurmstepd),
# other than this script and its subshells
ours() {
  local p state pgrp
  for p in /proc/[0-9]*; do
    read -r state _ pgrp _ < <(sed 's/.*) //' "$p/stat" 2>/dev/null) || continue  # after "(name) ": state ppid pgrp
    [ "$state" = Z ] || [ "$pgrp" = "$SELF_PGRP" ] && continue   # a zombie, or this script and its subshells
    tr '\0' '\n' 2>/dev/null < "$p/environ" | grep -qxF "ALIGNFL_SLURM_CHECK=$WORK" && echo "${p#/proc/}"
  done | tr '\n' ' '
}
cancel_jobs() {
  # Cancel what is still queued or running, and wait until SLURM lists no job and no step daemon of ours is left
  # (SLURM sends SIGTERM, then SIGKILL after KillWait, 30 s).
  [ -n "${SLURM_CONF:-}" ] && [ -f "$SLURM_CONF" ] && command -v squeue >/dev/null || return 0
  local jobs   # each job's id, an array's for its tasks (squeue's %i, e.g. 1_[1-3%4], is no id scancel takes)
  jobs=$(squeue -h -o %F 2>/dev/null | sort -u | tr '\n' ' ')
  [ -n "${jobs// }" ] || return 0
  say "cancelling jobs left: $jobs"
  scancel $jobs 2>/dev/null
  for _ in $(seq 120); do
    [ -z "$(squeue -h -o %i 2>/dev/null)" ] && [ "$(slurmstepd_pids)" = none ] && break
    sleep 0.5
  done
}
slurmstepd_pids() {   # this run's live slurmstepd processes, or "none"
  local pid found=""
  for pid in $(ours); do
    case "$(tr '\0' ' ' 2>/dev/null < "/proc/$pid/cmdline")" in slurmstepd*) found+="$pid ";; esac
  done
  echo "${found:-none}"
}
stop_children() {
  # The sweep this script waits for (its submitter, or a local sweep) and what it started.
  local pid
  for pid in "${CHILDREN[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "${CHILDREN[@]}"; do
    for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  done
  CHILDREN=()
}
stop_daemons() {
  # Cancel the jobs and wait for them, then stop the daemons by pid, last started first.
  cancel_jobs
  local i pid
  for ((i=${#PIDS[@]}-1; i>=0; i--)); do
    pid=${PIDS[$i]}
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  done
  PIDS=()
}
on_exit() {
  local code=$?
  # `timeout` signals this script and then its process group: a second signal must not cut this short.
  trap '' INT TERM HUP
  [ "$CLEANED" = 0 ] || exit $code
  CLEANED=1
  stop_children
  stop_daemons
  local left
  left=$(ours)
  if [ -n "${left// }" ]; then
    say "FAILED: processes of this check left after its daemons stopped: $left; stopping them"
    kill -KILL $left 2>/dev/null
    code=1
  fi
  exit $code
}
# in_background LOG COMMAND...: run it in the background, its output in LOG, and wait for it (a signal interrupts
# `wait` at once, where a command in the foreground would delay the trap until it ends); its exit code in CODE.
# (A redirection of this function's own output would also take what the trap says.)
in_background() {
  local log=$1
  shift
  "$@" > "$log" 2>&1 &
  CHILDREN+=($!)
  CODE=0
  wait $! || CODE=$?
  CHILDREN=()
}
# stop_on WHAT CODE: the first stop signal; any later one is ignored, so it cannot cut on_exit short
stop_on() { trap '' INT TERM HUP; say "$1"; exit "$2"; }
trap on_exit EXIT
trap 'stop_on interrupted 130' INT
trap 'stop_on terminated 143' TERM
trap 'stop_on "hung up" 129' HUP

# --- 1. tools -------------------------------------------------------------------------------------------------
step_start=$(date +%s)
missing=()
command -v slurmctld >/dev/null || missing+=(slurm-wlm)
command -v munged >/dev/null || missing+=(munge)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]} from Debian"
  { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"; } \
    > "$WORK/apt.log" 2>&1 || { record "install ${missing[*]}" FAIL "see $WORK/apt.log"; exit 1; }
fi
[ -x "$PY" ] || ./scripts/setup.sh > "$WORK/setup.log" 2>&1 || { record "project .venv" FAIL "see $WORK/setup.log"; exit 1; }
"$PY" -c "import hydra_plugins.hydra_submitit_launcher" 2>/dev/null \
  || "$PY" -m pip install -q -e . > "$WORK/pip.log" 2>&1 \
  || { record "hydra-submitit-launcher" FAIL "see $WORK/pip.log"; exit 1; }
record "tools (slurm-wlm $(slurmctld -V | awk '{print $2}'), munge)" PASS "$(( $(date +%s) - step_start )) s"

# --- 2. a one-node cluster ------------------------------------------------------------------------------------
step_start=$(date +%s)
free_port() { "$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
HOST=$(hostname)
CPUS=$(nproc)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
mkdir -p "$WORK/munge" "$WORK/state" "$WORK/spool" "$WORK/log"
chmod 755 "$WORK/munge"
dd if=/dev/urandom of="$WORK/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$WORK/munge/munge.key"
MUNGE_SOCKET=$WORK/munge/munge.socket
setsid munged --foreground --force --key-file "$WORK/munge/munge.key" --socket "$MUNGE_SOCKET" \
  --pid-file "$WORK/munge/munged.pid" --log-file "$WORK/log/munged.log" --seed-file "$WORK/munge/munged.seed" \
  > "$WORK/log/munged.out" 2>&1 &
PIDS+=($!)
export SLURM_CONF=$WORK/slurm.conf
cat > "$SLURM_CONF" <<EOF
# One-node SLURM cluster of scripts/slurm_check.sh
ClusterName=alignfl
SlurmctldHost=$HOST
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/log/slurmctld.log
SlurmdLogFile=$WORK/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$WORK/log/jobcomp.log
MinJobAge=3600
SlurmdParameters=config_overrides
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=alignfl Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
for _ in $(seq 50); do [ -S "$MUNGE_SOCKET" ] && break; sleep 0.1; done
setsid slurmctld -D -f "$SLURM_CONF" > "$WORK/log/slurmctld.out" 2>&1 &
PIDS+=($!)
setsid slurmd -D -f "$SLURM_CONF" > "$WORK/log/slurmd.out" 2>&1 &
PIDS+=($!)
up=""
for _ in $(seq 60); do
  if sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then up=1; break; fi
  sleep 1
done
if [ -z "$up" ]; then
  record "one-node cluster up" FAIL "sinfo: $(sinfo 2>&1 | tail -1); logs in $WORK/log"
  exit 1
fi
record "one-node cluster up (munged, slurmctld, slurmd)" PASS "$(( $(date +%s) - step_start )) s, pids ${PIDS[*]}"


# --- 3. a 2 x 2 sweep through SLURM, and the same sweep locally -----------------------------------------------
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}   # the compute node runs this checkout
export FLWR_TELEMETRY_ENABLED=0
SWEEP=(dataset=digits "sim.num_supernodes=$CLIENTS" "train.num_server_rounds=$ROUNDS" pan.mode=off,mul pan.a=0.1 seed=0,1)
step_start=$(date +%s)
in_background "$WORK/log/sweep-slurm.log" nice -n "$NICE" "$PY" -m alignfl.fl_app.sweep -m hydra/launcher=slurm \
  "${SWEEP[@]}" "hydra.sweep.dir=$WORK/sweep-slurm"
code=$CODE
slurm_s=$(( $(date +%s) - step_start ))
step_start=$(date +%s)
in_background "$WORK/log/sweep-local.log" nice -n "$NICE" "$PY" -m alignfl.fl_app.sweep -m sim.backend=batched \
  "${SWEEP[@]}" "hydra.sweep.dir=$WORK/sweep-local"
local_code=$CODE
local_s=$(( $(date +%s) - step_start ))
if [ $code -ne 0 ] || [ $local_code -ne 0 ]; then
  record "2 x 2 sweep (SLURM, local)" FAIL "exit codes $code, $local_code; logs in $WORK/log"
else
  check=$("$PY" - "$WORK" <<'PY'
import csv, json, sys
from pathlib import Path
work = Path(sys.argv[1])
jobs = sorted((work / "sweep-slurm").glob("**/job.json"))
ids = [json.loads(path.read_text())["slurm-job-id"] for path in jobs]
ended = {}
for line in (work / "log" / "jobcomp.log").read_text().splitlines():
    fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
    ended[fields.get("JobId")] = fields.get("JobState")
problems = []
if len(jobs) != 4 or None in ids:
    problems.append(f"{len(jobs)} job folders, SLURM job ids {ids}")
problems += [f"job {i}: SLURM's completion log says {ended.get(i)}" for i in ids if ended.get(i) != "COMPLETED"]
def table(folder):
    with (work / folder / "summary.csv").open() as stream:
        return [{k: v for k, v in row.items() if not k.startswith("job-time") and k != "sim.backend"}
                for row in csv.DictReader(stream)]  # the local sweep names sim.backend=batched, the config's default
slurm, local = table("sweep-slurm"), table("sweep-local")
if slurm != local:
    problems.append(f"reports differ:\n{slurm}\n{local}")
print("; ".join(problems) if problems else f"4 SLURM jobs {' '.join(ids)} COMPLETED; "
      f"report equal to the local sweep's: {[(r['pan.mode'], r['final-accuracy-mean']) for r in slurm]}")
sys.exit(1 if problems else 0)
PY
)
  if [ $? -eq 0 ]; then
    record "2 x 2 sweep through SLURM = local" PASS "SLURM ${slurm_s} s, local ${local_s} s; $check"
  else
    record "2 x 2 sweep through SLURM = local" FAIL "$check"
  fi
fi

# --- 4. jobs of a second sweep cancelled: one while RUNNING, one while PENDING --------------------------------
step_start=$(date +%s)
nice -n "$NICE" "$PY" -m alignfl.fl_app.sweep -m hydra/launcher=slurm dataset=digits "sim.num_supernodes=$CLIENTS" \
  "train.num_server_rounds=$ROUNDS" seed=0,1,2,3 "hydra.sweep.dir=$WORK/sweep-cancel" > "$WORK/log/sweep-cancel.log" 2>&1 &
sweep_pid=$!
CHILDREN+=($sweep_pid)
running="" pending="" started=""
for _ in $(seq 600); do   # a task RUNNING whose job has begun (submitit's log written): the sweep's job runs
  running=$(squeue -h -r -t RUNNING -o %i 2>/dev/null | head -1)
  if [ -n "$running" ]; then
    started=$(find "$WORK/sweep-cancel/.submitit" -name "${running}_*_log.out" 2>/dev/null | head -1)
    [ -n "$started" ] && break
  fi
  kill -0 $sweep_pid 2>/dev/null || break
  sleep 0.5
done
pending=$(squeue -h -r -t PENDING -o %i 2>/dev/null | tail -1)  # none where every task runs at once
cancelled="$running${pending:+ $pending}"
[ -n "$started" ] && scancel $cancelled
cancel_s=$(( $(date +%s) - step_start ))
code=0
wait $sweep_pid || code=$?
CHILDREN=()
check=$("$PY" - "$WORK" "$running" "$pending" "$started" <<'PY'
import csv, json, subprocess, sys
from pathlib import Path
work, running, pending, started = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
problems = [] if started else [f"no task of the sweep was seen running with its log (running: {running!r})"]
cancelled = [job for job in (running, pending) if job]
table = (work / "sweep-cancel" / "summary.md").read_text()
with (work / "sweep-cancel" / "summary.csv").open() as stream:
    (row,) = list(csv.DictReader(stream))
if (row["seeds"], row["failed"]) != (str(4 - len(cancelled)), str(len(cancelled))):
    problems.append(f"seeds {row['seeds']}, failed {row['failed']} (expected {4 - len(cancelled)} completed, "
                    f"{len(cancelled)} failed)")
named = {}
for job in cancelled:
    lines = [line for line in table.splitlines() if line.startswith("- ") and f"SLURM job {job} CANCELLED" in line]
    if not lines or ".submitit" not in lines[0]:
        problems.append(f"the report does not name {job} as cancelled with its log:\n{table}")
    else:
        named[job] = lines[0][2:]
if running and not problems:  # SLURM's own state of the array task (scontrol keeps it for MinJobAge)
    shown = subprocess.run(["scontrol", "show", "job", "-o", running], capture_output=True, text=True).stdout
    state = next((item.split("=", 1)[1] for item in shown.split() if item.startswith("JobState=")), None)
    recorded = {job["slurm_job_id"]: job["state"] for job in json.loads((work / "sweep-cancel" / "slurm-jobs.json").read_text())}
    if (state, recorded.get(running)) != ("CANCELLED", "CANCELLED"):
        problems.append(f"running job {running}: SLURM's state {state}, the sweep's record {recorded.get(running)}")
print("; ".join(problems) if problems else
      f"running job {running} (its log {Path(started).name} written) CANCELLED by SLURM; "
      + (f"pending job {pending} cancelled too; " if pending else "no job was pending; ")
      + " | ".join(named.values()) + f"; the other {4 - len(cancelled)} completed and count")
sys.exit(1 if problems else 0)
PY
)
if [ $? -eq 0 ] && [ $code -ne 0 ]; then
  record "scancel a running and a pending job" PASS "$(( $(date +%s) - step_start )) s (cancelled at ${cancel_s} s), sweep exit $code; $check"
else
  record "scancel a running and a pending job" FAIL "sweep exit $code (non-zero expected); $check"
fi

# --- 5. one job with sim.backend=ray: its own Ray on the compute node -------------------------------------------
step_start=$(date +%s)
in_background "$WORK/log/sweep-ray.log" nice -n "$NICE" env RAY_TMPDIR="$RAY_TMP" "$PY" -m alignfl.fl_app.sweep -m \
  hydra/launcher=slurm dataset=digits "sim.num_supernodes=$CLIENTS" "train.num_server_rounds=$ROUNDS" sim.backend=ray \
  sim.ray_cpus=$(( CPUS < 2 ? CPUS : 2 )) seed=0 "hydra.sweep.dir=$WORK/sweep-ray"
code=$CODE
check=$("$PY" - "$WORK" "$RAY_TMP" <<'PY'
import json, sys
from pathlib import Path
work, ray_tmp = Path(sys.argv[1]), Path(sys.argv[2])
problems = []
jobs = json.loads((work / "sweep-ray" / "slurm-jobs.json").read_text())
states = [job["state"] for job in jobs]
if states != ["COMPLETED"]:
    problems.append(f"SLURM states {states}")
# The sweep's ray backend runs `flwr run` on a private SuperLink inside the job (its output, submitit's log, names
# it); Flower's simulation runtime logs its Ray backend in the SuperLink's processes, not the job's; Ray makes its
# session in the job's RAY_TMPDIR (sbatch exports it).
job_output = "".join(log.read_text() for log in (work / "sweep-ray" / ".submitit").glob("**/*_log.out"))
if "Using SuperLink: local" not in job_output:
    problems.append("the job's output lacks flwr run's 'Using SuperLink: local' (the private SuperLink)")
sessions = sorted((ray_tmp / "ray").glob("session_2*"))
if not any((session / "logs" / "gcs_server.out").exists() for session in sessions):
    problems.append(f"no Ray session (its gcs_server log) in the job's RAY_TMPDIR {ray_tmp}/ray")
summaries = list((work / "sweep-ray").glob("**/summary.json"))
if len(summaries) != 1:
    problems.append(f"{len(summaries)} run summaries")
print("; ".join(problems) if problems else
      f"SLURM job {jobs[0]['slurm_job_id']} COMPLETED with Ray started in it (flwr run on its private local "
      f"SuperLink; Ray session {sessions[-1].name} in {ray_tmp}/ray); final accuracy "
      f"{json.loads(summaries[0].read_text())['final-accuracy']:.4f}")
sys.exit(1 if problems else 0)
PY
)
if [ $? -eq 0 ] && [ $code -eq 0 ]; then
  record "a job with sim.backend=ray on the node" PASS "$(( $(date +%s) - step_start )) s; $check"
else
  record "a job with sim.backend=ray on the node" FAIL "sweep exit $code; $check; log $WORK/log/sweep-ray.log"
fi

# --- 6. nothing left behind -------------------------------------------------------------------------------------
left_jobs=$(squeue -h 2>/dev/null | wc -l)
daemons=("${PIDS[@]}")
stop_daemons
rm -rf "$WORK/state" "$WORK/spool" "$WORK/munge" "$RAY_TMP"
alive=()
for pid in "${daemons[@]}"; do kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
# Processes of the jobs: any live (not zombie) slurmstepd, or process whose command line names the work folder
# (submitit's job runner does), other than this script and its own subshells.
strays=$(for p in /proc/[0-9]*; do
  { read -r _ _ state _ < "$p/stat"; cmd=$(tr '\0' ' ' < "$p/cmdline"); } 2>/dev/null || continue
  [ "$state" = Z ] && continue
  case "$cmd" in *slurm_check.sh*) continue;; esac
  case "$cmd" in *slurmstepd*|*"$WORK"*|*"$RAY_TMP"*) echo "${p#/proc/}";; esac
done | tr '\n' ' ')
strays+=$(ours)
if [ "$left_jobs" = 0 ] && [ ${#alive[@]} = 0 ] && [ -z "${strays// }" ] && [ ! -e "$WORK/state" ] && [ ! -e "$WORK/spool" ]; then
  record "nothing left (jobs, daemons, processes, spool)" PASS "stopped pids ${daemons[*]}"
else
  record "nothing left (jobs, daemons, processes, spool)" FAIL "jobs $left_jobs, daemons ${alive[*]:-none}, processes ${strays:-none}"
fi

echo
echo "== scripts/slurm_check.sh report ($(date -u +%Y-%m-%dT%H:%MZ), load $(cut -d' ' -f1-3 /proc/loadavg), $(( $(date +%s) - STARTED )) s) =="
printf '%s\n' "${RESULTS[@]}"
echo "work folder: $WORK (logs in $WORK/log, sweeps in $WORK/sweep-*)"
[ $FAILED = 0 ] && echo "PASS" || echo "FAIL"
exit $FAILED
