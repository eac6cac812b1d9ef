"""A round of the loopback deployment with Flower's executor and SuperNode, and with the warm executor and the
SuperNode that polls faster, side by side.

Two measurements, each taken for every set-up in turn so that all see the same load:

* **Start-up per message**: the CPU-seconds a ClientApp process spends before the ClientApp's first line:
  what ``flwr-clientapp`` imports (its entry point and Flower's ClientApp runner) and what loading the app
  imports (``alignfl.fl_app.client_app``). Flower's executor pays them in a fresh interpreter (measured as a child of
  this process); the warm executor's child, forked from its warm parent, pays the child's set-up and the app's
  own packages, which it imports afresh from the FAB (it calls the runner its parent imported; measured by the
  parent's ``wait4``).
* **Rounds**: ``python -m alignfl.fl_app.deploy --executor E --node-poll P`` (SuperLink, N SuperNodes and their
  SuperExecs on 127.0.0.1, the digits MLP) for a few rounds, each round's wall time from ``metrics.jsonl``; the
  runs alternate between the set-ups (``--setups``: Flower's executor and SuperNode, the warm executor with
  Flower's SuperNode, the warm executor with a SuperNode asking every 0.5 s and the SuperLink's state in a
  SQLite file, and the same with the state in memory: the defaults). Beside them, the CPU-seconds and
  wall seconds of every message's ClientApp process of the warm runs (from the executor's log) and of the whole
  deployment. Flower's SuperNode that finds no message sleeps 3 s, and it finds none right after replying, so
  each wave of messages (a round has two: train, then evaluate) waits up to 3 s for it.

    python benchmarks/deploy_round.py --rounds 4 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchutil import append_jsonl, machine, median, read_jsonl, round_seconds, write_report

from alignfl.fl_app.patches import seam
from alignfl.fl_app.patches.polling_supernode import node_poll_interval

ROOT = Path(__file__).resolve().parents[1]
PYTHON = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
EXECUTORS = ("flower", "warm")
DEFAULT_SETUPS = ("flower/flower", "warm/flower", "warm/0.5/file", "warm/0.5")
"""``EXECUTOR/NODE-POLL[/file]``: ``python -m alignfl.fl_app.deploy --executor EXECUTOR --node-poll NODE-POLL`` (with
``/file``: ``--superlink-db`` in the run's folder; else the SuperLink's state in memory, the default)."""
RUNNER = seam.INTERNALS["flwr.supernode.runtime.run_clientapp.run_clientapp"].module
ENDED = re.compile(r"ClientApp process pid \d+ ended with code 0 after ([\d.]+) s, ([\d.]+) CPU-s")


def valid_setup(setup: str) -> bool:
    """Whether ``setup`` is ``EXECUTOR/NODE-POLL[/file]`` with values ``alignfl.fl_app.runtime.deploy`` takes."""
    executor, _, rest = setup.partition("/")
    poll, _, state = rest.partition("/")
    try:
        node_poll_interval(poll)
    except argparse.ArgumentTypeError:
        return False
    return executor in EXECUTORS and state in ("", "file")


def startup_imports(executor: str) -> str:
    """What a ClientApp process imports before the ClientApp's first line, as a statement. ``flower``
    (``flwr-clientapp``): the module its console script imports it from, Flower's ClientApp runner and the app
    (``load_app``); ``warm`` (a warm child): the runner (its parent's) and the app. The module names are the
    seam's, found without importing anything."""
    modules = [RUNNER, "alignfl.fl_app.client_app"]
    if executor == "flower":
        modules.insert(0, seam.flower_command_module("flwr-clientapp"))
    return f"import {', '.join(modules)}"


def clientapp_startup(_spec: dict[str, Any]) -> None:
    """The warm child's part (the app's own packages are not imported yet: the warm parent forgot them)."""
    exec(startup_imports("warm"))  # pylint: disable=exec-used


def environment() -> dict[str, str]:
    """The project and this folder importable (the warm parent imports :func:`clientapp_startup` from here)."""
    path = os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep), "FLWR_TELEMETRY_ENABLED": "0"}


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def flower_startup_cpu_s() -> float:
    """A fresh interpreter doing what a ``flwr-clientapp`` process does before the app's first line."""
    before = children_cpu_s()
    subprocess.run([PYTHON, "-c", startup_imports("flower")], cwd=ROOT, check=True, env=environment())
    return children_cpu_s() - before


def warm_startup_cpu_s(samples: int) -> tuple[list[float], float]:
    """``samples`` children of one warm parent doing the same; their CPU-seconds, and the parent's own
    (paid once per SuperNode)."""
    os.environ.update(environment())
    from alignfl.fl_app.patches.warm_executor import WarmExecutor

    task_type = seam.get("flwr.supercore.constant.TaskType")
    execution_spec = seam.get("flwr.supercore.superexec.executor.ExecutionSpec")

    before = children_cpu_s()
    executor = WarmExecutor(["--target", "deploy_round:clientapp_startup"])
    try:
        for task in range(1, samples + 1):
            executor.launch(
                execution_spec(
                    task_type=task_type.CLIENT_APP,
                    runtime_api_address="127.0.0.1:9",
                    token="benchmark",
                    insecure=True,
                    root_certificates_path=None,
                    runtime_dependency_install=False,
                    parent_pid=os.getpid(),
                    suppress_output=False,
                    task_id=task,
                )
            )
            if not executor.wait_idle(600.0):
                raise RuntimeError("the warm parent's child did not end")
        if set(executor.outcomes.values()) != {"code 0"}:
            raise RuntimeError(f"warm children failed: {executor.outcomes}")
        cpu = [executor.cpu_s[task] for task in range(1, samples + 1)]
    finally:
        executor.close()
    return cpu, children_cpu_s() - before - sum(cpu)


TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def process_table() -> dict[int, tuple[int, float, str]]:
    """pid -> (parent pid, CPU-seconds of the process and of its children it waited for, command line)."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        table[int(stat.parent.name)] = (int(fields[1]), sum(int(value) for value in fields[11:15]) * TICK_S, command)
    return table


def service_kind(command: str, superlink_port: str) -> str:
    """Which part of the deployment a direct child of ``alignfl.fl_app.runtime.deploy`` is."""
    if "flower-superlink" in command:
        return "SuperLink"
    if "supernode" in command:
        return "SuperNodes"
    if "superexec" in command:
        dialled = command.split("--runtime-api-address ")[1].split()[0]
        return (
            "ServerApp executor and ServerApp"
            if dialled.endswith(f":{superlink_port}")
            else "ClientApp executors and their ClientApp processes"
        )
    if "flwr log" in command:
        return "flwr log --stream (deploy's live log)"
    return "other"


def service_cpu_s(deploy_pid: int) -> dict[str, float]:
    """CPU-seconds so far of each kind of service the deployment started (each with every descendant, alive or
    waited for), and of ``alignfl.fl_app.runtime.deploy`` itself."""
    table = process_table()
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)

    def tree_cpu(pid: int) -> float:
        return table[pid][1] + sum(tree_cpu(child) for child in children.get(pid, []))

    services = children.get(deploy_pid, [])
    port = next(
        (table[pid][2].split("--port ")[1].split()[0] for pid in services if "flower-superlink" in table[pid][2]), ""
    )
    totals = {"deploy itself": table[deploy_pid][1] if deploy_pid in table else 0.0}
    for pid in services:
        kind = service_kind(table[pid][2], port)
        totals[kind] = totals.get(kind, 0.0) + tree_cpu(pid)
    return totals


def deploy_rounds(
    setup: str, nodes: int, rounds: int, work: Path
) -> tuple[list[float], list[tuple[float, float]], float, dict[str, float]]:
    """Wall seconds of rounds 1..``rounds`` of one deployed run, (wall s, CPU-s) of every ClientApp process the
    warm executor logged, the CPU-seconds of the whole deployment (every process it started, with their
    children, as far as they were waited for: the load of the machine does not change them), and each service's
    CPU-seconds per round from the end of round 1 to the end of the last round but one (sampled from ``/proc``
    as ``metrics.jsonl`` grows)."""
    results = work / "results"
    overrides = f'dataset="digits" results-dir="{results}" run-name="bench"'
    before = children_cpu_s()
    executor, node_poll, *state = setup.split("/")
    database = ["--superlink-db", str(work / "superlink.db")] if state == ["file"] else []
    process = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "alignfl.fl_app.deploy",
            "--executor",
            executor,
            "--node-poll",
            node_poll,
            *database,
            "--num-supernodes",
            str(nodes),
            "--rounds",
            str(rounds),
            "--run-config",
            overrides,
            "--work-dir",
            str(work / "deploy"),
        ],
        cwd=ROOT,
        env=environment(),
        stdout=subprocess.DEVNULL,
    )
    metrics, marks = results / "bench" / "metrics.jsonl", {}
    while process.poll() is None:  # rows: round 0's evaluation, then one per round
        done = metrics.read_text().count("\n") - 1 if metrics.exists() else -1
        if done in (1, rounds - 1) and done not in marks:
            marks[done] = service_cpu_s(process.pid)
        time.sleep(0.05)
    if process.returncode != 0:
        raise RuntimeError(f"the {setup} deployment failed with exit code {process.returncode}")
    cpu = children_cpu_s() - before
    first, last = marks.get(1, {}), marks.get(rounds - 1, {})
    per_round = {kind: (last[kind] - first.get(kind, 0.0)) / (rounds - 2) for kind in last} if rounds > 2 else {}
    rows = read_jsonl(results / "bench" / "metrics.jsonl")
    messages = [
        (float(wall), float(cpu))
        for log in (work / "deploy" / "logs").glob("superexec-clientapp-*.log")
        for wall, cpu in ENDED.findall(log.read_text(errors="replace"))
    ]
    return round_seconds(rows), messages, cpu, per_round


def measure(args: argparse.Namespace, rows_path: Path) -> None:
    for sample in range(args.samples):
        append_jsonl(
            rows_path,
            {"kind": "startup", "executor": "flower", "cpu-s": [flower_startup_cpu_s()], "machine": machine()},
        )
        if sample == 0:  # one warm parent serves every sample, as one serves every message of a node
            cpu, parent = warm_startup_cpu_s(args.samples)
            append_jsonl(
                rows_path,
                {"kind": "startup", "executor": "warm", "cpu-s": cpu, "parent-cpu-s": parent, "machine": machine()},
            )
    for repeat in range(args.repeats):
        for setup in args.setups if repeat % 2 == 0 else args.setups[::-1]:
            load_before = os.getloadavg()[0]
            with tempfile.TemporaryDirectory(prefix="alignfl-deploy-round-") as work:
                rounds, messages, cpu, services = deploy_rounds(setup, args.nodes, args.rounds, Path(work))
            append_jsonl(
                rows_path,
                {
                    "kind": "rounds",
                    "setup": setup,
                    "repeat": repeat,
                    "seconds": rounds,
                    "messages": messages,
                    "deployment-cpu-s": cpu,
                    "service-cpu-s": services,
                    "load-before": round(load_before, 2),
                    "machine": machine(),
                },
            )


def load(selected: list[dict[str, Any]]) -> str:
    values = [row["machine"]["load-average-1-5-15"][0] for row in selected]
    return f"{min(values):.1f}–{max(values):.1f}" if values else "-"


def startup_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| executor | start-up per message, CPU-s (median) | load (1 min) |", "|---|---|---|"]
    medians = {}
    for executor in EXECUTORS:
        startup = [row for row in rows if row["kind"] == "startup" and row["executor"] == executor]
        medians[executor] = median([value for row in startup for value in row["cpu-s"]])
        lines.append(f"| {executor} | {medians[executor]:.2f} | {load(startup)} |")
    lines.append(f"| flower / warm | {medians['flower'] / medians['warm']:.1f}× | |")
    parents = [row["parent-cpu-s"] for row in rows if row["kind"] == "startup" and row["executor"] == "warm"]
    lines.append(f"\nThe warm parent's own start-up (once per SuperNode): {median(parents):.2f} CPU-s.")
    return lines


def rounds_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| executor / SuperNode poll / SuperLink state | round 1, s | rounds 2+, s (median) | ClientApp process per message: wall s, "
        "CPU-s (median) | deployment CPU-s per run (median) | load (1 min) |",
        "|---|---|---|---|---|---|",
    ]
    setups = list(dict.fromkeys(row["setup"] for row in rows if row["kind"] == "rounds"))
    medians: dict[str, float] = {}
    for setup in setups:
        runs = [row for row in rows if row["kind"] == "rounds" and row["setup"] == setup]
        medians[setup] = median([value for row in runs for value in row["seconds"][1:]])
        messages = [message for row in runs for message in row["messages"]]
        per_message = (
            f"{median([wall for wall, _ in messages]):.2f}, {median([c for _, c in messages]):.2f} ({len(messages)})"
            if messages
            else "-"
        )
        deployment = median([row["deployment-cpu-s"] for row in runs])
        first = ", ".join(f"{row['seconds'][0]:.1f}" for row in runs)
        executor, poll, *state = setup.split("/")
        poll = "Flower's 3 s" if poll == "flower" else f"{poll} s"
        lines.append(
            f"| {executor} / {poll} / {'file' if state else 'memory'} | {first} | {medians[setup]:.2f} | {per_message} | {deployment:.1f} | "
            f"{load(runs)} |"
        )
    baseline = setups[0]
    for setup in setups[1:]:
        lines.append(f"\nRounds 2+, {baseline} / {setup}: {medians[baseline] / medians[setup]:.1f}×.")
    return lines


def services_table(rows: list[dict[str, Any]]) -> list[str]:
    runs = [row for row in rows if row["kind"] == "rounds" and row.get("service-cpu-s")]
    setups = list(dict.fromkeys(row["setup"] for row in runs))
    kinds = list(dict.fromkeys(kind for row in runs for kind in row["service-cpu-s"]))
    if not runs:
        return []
    lines = [
        "CPU-seconds per round of each part of the deployment (rounds 2 to the last but one, medians over runs):",
        "",
        f"| part | {' | '.join(setups)} |",
        "|---|" + "---|" * len(setups),
    ]
    for kind in [*kinds, "total"]:
        cells = []
        for setup in setups:
            values = [
                sum(row["service-cpu-s"].values()) if kind == "total" else row["service-cpu-s"].get(kind, 0.0)
                for row in runs
                if row["setup"] == setup
            ]
            cells.append(f"{median(values):.2f}")
        lines.append(f"| {kind} | {' | '.join(cells)} |")
    return lines


def report(rows: list[dict[str, Any]]) -> str:
    return "\n".join([*startup_table(rows), "", *rounds_table(rows), "", *services_table(rows)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="deployed runs per set-up")
    parser.add_argument(
        "--setups",
        nargs="+",
        default=list(DEFAULT_SETUPS),
        help=f"EXECUTOR/NODE-POLL set-ups to deploy (default {' '.join(DEFAULT_SETUPS)})",
    )
    parser.add_argument("--samples", type=int, default=5, help="start-up samples per executor")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "alignfl-deploy-round")
    args = parser.parse_args()
    for setup in args.setups:
        if not valid_setup(setup):
            parser.error(
                f"--setups {setup!r} is not allowed: EXECUTOR/NODE-POLL[/file] with EXECUTOR one of "
                f"{', '.join(EXECUTORS)}, NODE-POLL seconds in (0, 3] or flower"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / "rows.jsonl"
    rows_path.unlink(missing_ok=True)
    measure(args, rows_path)
    return write_report(args.out, rows_path, report)


if __name__ == "__main__":
    raise SystemExit(main())
