"""A round of the loopback deployment with Flower's executor and with the warm one, side by side (issue 24).

Two measurements, each taken for both executors in turn so that both see the same load:

* **Start-up per message**: the CPU-seconds a ClientApp process spends before the ClientApp's first line:
  what ``flwr-clientapp`` imports (its entry point and Flower's ClientApp runner) and what loading the app
  imports (``fl_app.client_app``). Flower's executor pays them in a fresh interpreter (measured as a child of
  this process); the warm executor's child, forked from its warm parent, pays the child's set-up and the app's
  own packages, which it imports afresh from the FAB (it calls the runner its parent imported; measured by the
  parent's ``wait4``).
* **Rounds**: ``python -m fl_app.deploy --executor E`` (SuperLink, N SuperNodes and their SuperExecs on
  127.0.0.1, the digits MLP) for a few rounds, each round's wall time from ``metrics.jsonl``; the runs
  alternate between the executors. Beside them, the CPU-seconds and wall seconds of every message's ClientApp
  process of the warm runs (from the executor's log), and the SuperNode's poll, which neither executor changes:
  a SuperNode that finds no message sleeps 3 s, and it finds none right after replying, so each wave of
  messages (a round has two: train, then evaluate) waits about 3 s for it.

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
from pathlib import Path
from typing import Any

from benchutil import append_jsonl, machine, median, read_jsonl, round_seconds, write_report

ROOT = Path(__file__).resolve().parents[1]
PYTHON = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
EXECUTORS = ("flower", "warm")
POLL_S = 3.0
"""The SuperNode's sleep when it finds no message (``flwr/supernode/start_client_internal.py``)."""
STARTUP = {
    "flower": "import flwr.supernode.cli.flwr_clientapp, flwr.supernode.runtime.run_clientapp, fl_app.client_app",
    "warm": "import flwr.supernode.runtime.run_clientapp, fl_app.client_app",
}
"""What a ClientApp process imports before the ClientApp's first line. ``flwr-clientapp``: its entry point, Flower's
ClientApp runner and the app (``load_app``); a warm child: the runner (its parent's) and the app."""
ENDED = re.compile(r"ClientApp process pid \d+ ended with code 0 after ([\d.]+) s, ([\d.]+) CPU-s")


def clientapp_startup(_spec: dict[str, Any]) -> None:
    """The warm child's part (the app's own packages are not imported yet: the warm parent forgot them)."""
    exec(STARTUP["warm"])  # pylint: disable=exec-used


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
    subprocess.run([PYTHON, "-c", STARTUP["flower"]], cwd=ROOT, check=True, env=environment())
    return children_cpu_s() - before


def warm_startup_cpu_s(samples: int) -> tuple[list[float], float]:
    """``samples`` children of one warm parent doing the same; their CPU-seconds, and the parent's own
    (paid once per SuperNode)."""
    os.environ.update(environment())
    from fl_app.warm_executor import WarmExecutor
    from flwr.supercore.constant import TaskType
    from flwr.supercore.superexec.executor import ExecutionSpec

    before = children_cpu_s()
    executor = WarmExecutor(["--target", "deploy_round:clientapp_startup"])
    try:
        for task in range(1, samples + 1):
            executor.launch(ExecutionSpec(
                task_type=TaskType.CLIENT_APP, runtime_api_address="127.0.0.1:9", token="benchmark", insecure=True,
                root_certificates_path=None, runtime_dependency_install=False, parent_pid=os.getpid(),
                suppress_output=False, task_id=task))
            if not executor.wait_idle(600.0):
                raise RuntimeError("the warm parent's child did not end")
        if set(executor.outcomes.values()) != {"code 0"}:
            raise RuntimeError(f"warm children failed: {executor.outcomes}")
        cpu = [executor.cpu_s[task] for task in range(1, samples + 1)]
    finally:
        executor.close()
    return cpu, children_cpu_s() - before - sum(cpu)


def deploy_rounds(executor: str, nodes: int, rounds: int, work: Path) -> tuple[list[float], list[tuple[float, float]],
                                                                            float]:
    """Wall seconds of rounds 1..``rounds`` of one deployed run, (wall s, CPU-s) of every ClientApp process the
    warm executor logged, and the CPU-seconds of the whole deployment (every process it started, with their
    children, as far as they were waited for: the load of the machine does not change them)."""
    results = work / "results"
    overrides = f'dataset="digits" results-dir="{results}" run-name="bench"'
    before = children_cpu_s()
    subprocess.run([PYTHON, "-m", "fl_app.deploy", "--executor", executor, "--num-supernodes", str(nodes),
                    "--rounds", str(rounds), "--run-config", overrides, "--work-dir", str(work / "deploy")],
                   cwd=ROOT, check=True, env=environment(), stdout=subprocess.DEVNULL)
    cpu = children_cpu_s() - before
    rows = read_jsonl(results / "bench" / "metrics.jsonl")
    messages = [(float(wall), float(cpu)) for log in (work / "deploy" / "logs").glob("superexec-clientapp-*.log")
                for wall, cpu in ENDED.findall(log.read_text(errors="replace"))]
    return round_seconds(rows), messages, cpu


def measure(args: argparse.Namespace, rows_path: Path) -> None:
    for sample in range(args.samples):
        append_jsonl(rows_path, {"kind": "startup", "executor": "flower", "cpu-s": [flower_startup_cpu_s()],
                                 "machine": machine()})
        if sample == 0:  # one warm parent serves every sample, as one serves every message of a node
            cpu, parent = warm_startup_cpu_s(args.samples)
            append_jsonl(rows_path, {"kind": "startup", "executor": "warm", "cpu-s": cpu, "parent-cpu-s": parent,
                                     "machine": machine()})
    for repeat in range(args.repeats):
        for executor in EXECUTORS if repeat % 2 == 0 else EXECUTORS[::-1]:
            load_before = os.getloadavg()[0]
            with tempfile.TemporaryDirectory(prefix="alignfl-deploy-round-") as work:
                rounds, messages, cpu = deploy_rounds(executor, args.nodes, args.rounds, Path(work))
            append_jsonl(rows_path, {"kind": "rounds", "executor": executor, "repeat": repeat, "seconds": rounds,
                                     "messages": messages, "deployment-cpu-s": cpu,
                                     "load-before": round(load_before, 2),
                                     "machine": machine()})


def report(rows: list[dict[str, Any]]) -> str:
    def load(selected: list[dict[str, Any]]) -> str:
        values = [row["machine"]["load-average-1-5-15"][0] for row in selected]
        return f"{min(values):.1f}–{max(values):.1f}" if values else "-"

    lines = ["| executor | start-up per message, CPU-s (median) | round 1, s | rounds 2+, s (median) | "
             "ClientApp process per message: wall s, CPU-s (median) | deployment CPU-s per run | load (1 min) |",
             "|---|---|---|---|---|---|---|"]
    medians: dict[str, tuple[float, float, float]] = {}
    for executor in EXECUTORS:
        startup = [row for row in rows if row["kind"] == "startup" and row["executor"] == executor]
        runs = [row for row in rows if row["kind"] == "rounds" and row["executor"] == executor]
        cpu = median([value for row in startup for value in row["cpu-s"]])
        later = median([value for row in runs for value in row["seconds"][1:]])
        messages = [message for row in runs for message in row["messages"]]
        per_message = (f"{median([wall for wall, _ in messages]):.2f}, {median([c for _, c in messages]):.2f} "
                       f"({len(messages)})" if messages else "-")
        deployment = median([row["deployment-cpu-s"] for row in runs if "deployment-cpu-s" in row])
        medians[executor] = (cpu, later, deployment)
        first = ", ".join(f"{row['seconds'][0]:.1f}" for row in runs)
        lines.append(f"| {executor} | {cpu:.2f} | {first} | {later:.2f} | {per_message} | {deployment:.1f} | "
                     f"{load(startup + runs)} |")
    if all(executor in medians for executor in EXECUTORS):
        ratios = [f"{flower / warm:.1f}×" for flower, warm in zip(medians["flower"], medians["warm"])]
        lines.append(f"| flower / warm | {ratios[0]} | | {ratios[1]} | | {ratios[2]} | |")
    parents = [row["parent-cpu-s"] for row in rows if row["kind"] == "startup" and row["executor"] == "warm"]
    if parents:
        lines.append(f"\nThe warm parent's own start-up (once per SuperNode): {median(parents):.2f} CPU-s. The "
                     f"SuperNode's poll: {POLL_S:.0f} s per wave of messages, two waves per round.")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="deployed runs per executor")
    parser.add_argument("--samples", type=int, default=5, help="start-up samples per executor")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "alignfl-deploy-round")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / "rows.jsonl"
    rows_path.unlink(missing_ok=True)
    measure(args, rows_path)
    return write_report(args.out, rows_path, report)


if __name__ == "__main__":
    raise SystemExit(main())
