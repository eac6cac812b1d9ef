"""The real compose deployment, end to end: the scenarios of ``scripts/compose_check.sh`` (not part of CI).

The script sets the machine up (Docker engine, Compose v2, the daemon, the project image) and then runs
``tests/compose_scenarios.py``, which drives docker-compose.yml's stacks with the project's own deployment
code (:mod:`alignfl.fl_app.runtime.flwr_cli`, :mod:`alignfl.fl_app.runtime.superlink`,
:mod:`alignfl.fl_app.runtime.topology`):

1. plain stack: up, every SuperNode online; a run of ``--rounds`` rounds on digits (MLP), served by SuperNodes
   that poll every 0.5 s and warm ClientApp processes (their logs say so);
2. a run in which one SuperNode's containers are killed after round 1 must still complete;
3. ``down -v``: no container, network or volume of the project left;
4. the same topology as local processes (``python -m alignfl.fl_app.deploy``, what ``./scripts/deploy.sh`` runs) with
   the same seed and run config: the final accuracies are compared;
5. TLS + SuperNode authentication stack (compose.tls.yml, keys from ``scripts/make_certs.sh``): a SuperNode with
   an unregistered key is refused, a run completes (served as in 1); ``down -v``.

Each step is recorded (result, seconds, name, note) as a tab-separated line in ``WORK/steps.tsv``, which the
script's report prints with its own set-up steps. A failed critical step ends the check; the stacks are taken
down whatever happens (also on Ctrl-C or SIGTERM, after which it exits with 128 + the signal's number).

    python tests/compose_scenarios.py --work-dir /tmp/check --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compose_stack import (
    CONTAINER_UID,
    NODES,
    PLAIN,
    STEP_GROUPS,
    TLS,
    CheckEnded,
    Recorder,
    Settings,
    Stack,
    Step,
    StepFailed,
    docker,
    project_leftovers,
)

from alignfl.fl_app.runtime.flwr_cli import (
    CONNECTION,
    SubmitError,
    flwr_cli,
    online_supernodes,
    run_status,
    submit,
    to_toml_pairs,
)
from alignfl.fl_app.runtime.processes import ProcessTree, Stopped, log_tail, start_process, stop_processes, stop_signals
from alignfl.fl_app.runtime.superlink import wait_until
from alignfl.fl_app.runtime.topology import (
    compose_topology,
    make_certificates,
    supernode_command,
    supernode_entry_point,
)

PROJECT_ROOT = Path(__file__).resolve().parents[1]
"""The checkout the tests run in."""

# --- runs ---


def run_config(name: str, min_nodes: int, rounds: int, seed: int) -> dict[str, Any]:
    """The run config of every run here, the same but for these values."""
    return {
        "dataset": "digits",
        "model": "mlp",
        "num-server-rounds": rounds,
        "seed": seed,
        "min-available-nodes": min_nodes,
        "run-name": name,
    }


def metric_rows(folder: Path) -> list[dict[str, Any]]:
    """``metrics.jsonl``'s complete lines (a line being written is left out)."""
    path = folder / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def final_accuracy(folder: Path) -> float:
    summary = folder / "summary.json"
    if not summary.is_file():
        raise StepFailed(f"no {summary}")
    return float(json.loads(summary.read_text())["final-accuracy"])


def clients_trained(folder: Path) -> list[Any]:
    """Clients trained per round (round 0 is the initial evaluation)."""
    return [row.get("clients-trained") for row in metric_rows(folder)[1:]]


@dataclass
class Run:
    """A submitted run on a stack, its log streamed to a file until it is finished."""

    run_id: str
    name: str
    env: dict[str, str]
    log: Path
    stream: ProcessTree

    def status(self) -> tuple[str, str]:
        """Its status now."""
        return run_status(self.run_id, self.env, timeout_s=0.0)

    def finish(self, timeout_s: float) -> None:
        """Wait until it is finished; a hung run is stopped (``flwr stop``) and fails the step, as does a run that
        did not complete."""
        try:
            status, details = run_status(self.run_id, self.env, timeout_s=timeout_s, interval_s=2.0)
            if not status.startswith("finished"):
                flwr_cli(["stop", self.run_id], self.env)
                raise StepFailed(
                    f"HUNG: run {self.name} ({self.run_id}) not finished after {timeout_s:.0f} s (last "
                    f"status: {status}); stopped with flwr stop"
                )
            if status != "finished:completed":
                raise StepFailed(
                    f"run {self.name} ended {status}: {details[:200]}; its log ends: {log_tail(self.log, 10)}"
                )
        finally:
            stop_processes([self.stream], grace_s=5.0)


def start_run(stack: Stack, config: dict[str, Any]) -> Run:
    """Submit the run to the stack's SuperLink and stream its log to ``logs/run-NAME.log``."""
    env = stack.cli_environment
    try:
        run_id = submit(config, env, [CONNECTION])
    except SubmitError as error:
        raise StepFailed(f"flwr run failed: {str(error)[-300:]}") from None
    log = stack.work / "logs" / f"run-{config['run-name']}.log"
    with log.open("w") as stream:
        tree = start_process(
            ["flwr", "log", run_id, "--stream"], env, PROJECT_ROOT, stdout=stream, stderr=subprocess.STDOUT
        )
    run = Run(run_id, config["run-name"], env, log, tree)
    print(f"[compose-check] run {run.name} submitted: run id {run_id} (log: {log})", flush=True)
    return run


# --- the scenarios ---


@dataclass
class ComposeCheck:
    """The scenarios, in order, with what they share (the plain run's accuracy, the runs' log streams)."""

    settings: Settings
    recorder: Recorder
    plain_accuracy: float | None = None
    runs: list[Run] = field(default_factory=list)

    @property
    def work(self) -> Path:
        return self.settings.work

    def stack(self, mode: str) -> Stack:
        return Stack(TLS if mode == "tls" else PLAIN, self.work, mode)

    def start_run(self, stack: Stack, name: str, min_nodes: int, rounds: int | None = None) -> Run:
        config = run_config(name, min_nodes, rounds or self.settings.rounds, self.settings.seed)
        run = start_run(stack, config)
        self.runs.append(run)
        return run

    def plain_run(self) -> str:
        stack = self.stack("plain")
        run = self.start_run(stack, "compose-plain", NODES)
        run.finish(self.settings.run_timeout_s)
        folder = self.work / "results" / run.name
        self.plain_accuracy = final_accuracy(folder)
        rounds = [row["round"] for row in metric_rows(folder)]
        if rounds != list(range(self.settings.rounds + 1)):
            raise StepFailed(f"rounds in metrics.jsonl: {rounds}")
        return (
            f"run {run.run_id} completed; rounds {rounds}, clients trained per round {clients_trained(folder)}; "
            f"final accuracy {self.plain_accuracy:.4f}; {stack.served_by_warm_processes()}"
        )

    def kill_supernode(self) -> str:
        stack, settings = self.stack("plain"), self.settings
        run = self.start_run(stack, "compose-kill", settings.kill_min_nodes, settings.kill_rounds)
        folder = self.work / "results" / run.name
        try:
            wait_until(
                lambda: len(metric_rows(folder)) >= 2 or run.status()[0].startswith("finished"),
                settings.run_timeout_s,
                "round 1's metrics",
                interval_s=2.0,
            )
        except TimeoutError as error:
            raise StepFailed(str(error)) from None
        status = run.status()[0]
        if status.startswith("finished"):
            raise StepFailed(f"the run ended before round 1 was recorded ({status})")
        print("[compose-check] round 1 recorded: SIGKILL supernode-2 and superexec-clientapp-2", flush=True)
        killed = stack.compose("kill", "-s", "SIGKILL", "supernode-2", "superexec-clientapp-2", log=stack.log("kill"))
        if killed.returncode != 0:
            raise StepFailed(f"docker compose kill failed: {log_tail(stack.log('kill'), 5)}")
        killed_at = time.monotonic()
        try:
            run.finish(settings.run_timeout_s)
        except StepFailed as failure:
            raise StepFailed(f"{failure} (min-available-nodes={settings.kill_min_nodes})") from None
        trained = clients_trained(folder)
        expected = [NODES] + [NODES - 1] * (settings.kill_rounds - 1)
        if trained != expected:
            raise StepFailed(
                f"clients trained per round {trained}: expected {NODES} in round 1, {NODES - 1} in "
                f"rounds 2-{settings.kill_rounds}"
            )
        dropped = str(metric_rows(folder)[2].get("clients-dropped-reasons"))[:100]
        return (
            f"node 2 killed after round 1; run {run.run_id} ({settings.kill_rounds} rounds, min-available-nodes="
            f"{settings.kill_min_nodes}) completed {time.monotonic() - killed_at:.0f} s later; clients trained "
            f"per round {trained}; round 2 dropped: {dropped}"
        )

    def loopback(self) -> str:
        """The same topology as local processes, with the same run config: ``python -m alignfl.fl_app.deploy``."""
        name, results = "loopback-plain", self.work / "results-loopback"
        config = {**run_config(name, NODES, self.settings.rounds, self.settings.seed), "results-dir": str(results)}
        log = self.work / "logs" / "deploy-loopback.log"
        command = [
            sys.executable,
            "-m",
            "alignfl.fl_app.deploy",
            "--num-supernodes",
            str(NODES),
            "--work-dir",
            str(self.work / "loopback"),
            "--run-config",
            to_toml_pairs(config),
        ]
        with log.open("w") as stream:
            deploy = start_process(command, dict(os.environ), PROJECT_ROOT, stdout=stream, stderr=subprocess.STDOUT)
        try:
            code = deploy.process.wait(timeout=self.settings.run_timeout_s + 300)
        except subprocess.TimeoutExpired:
            raise StepFailed(f"python -m alignfl.fl_app.deploy did not end in time (log: {log})") from None
        finally:
            stop_processes([deploy], grace_s=30.0)
        if code != 0:
            raise StepFailed(f"python -m alignfl.fl_app.deploy exited {code} (log: {log}): {log_tail(log, 5)}")
        loopback = final_accuracy(results / name)
        if self.plain_accuracy is None:
            raise StepFailed(f"loopback final accuracy {loopback:.4f}, but the compose run has none to compare")
        diff = abs(self.plain_accuracy - loopback)
        note = (
            f"final accuracy: compose {self.plain_accuracy:.4f}, loopback {loopback:.4f} (|diff| {diff:.4f}, "
            f"accepted up to {self.settings.compare_tol})"
        )
        if diff > self.settings.compare_tol:
            raise StepFailed(note)
        return note

    def tls_up(self) -> str:
        stack = self.stack("tls")
        make_certificates(stack.certs, NODES + 1)  # node NODES's key is made, never registered
        for folder, _, files in os.walk(stack.certs):  # the containers' user reads the keys
            for path in [folder, *(os.path.join(folder, file) for file in files)]:
                os.chown(path, CONTAINER_UID, CONTAINER_UID)
        note = stack.up()
        register = stack.compose("ps", "-aq", "supernode-register").stdout.split()
        logs = docker("logs", register[0]) if register else ""
        registered = next((line.split("] ", 1)[-1] for line in logs.splitlines() if "registered" in line), "?")
        return f"{note}; supernode-register: {registered}; key of node {NODES} made but not registered"

    def tls_unregistered(self) -> str:
        """A SuperNode with make_certs.sh's key for node NODES, which supernode-register did not register: the
        SuperLink answers [code: 2004] (FLEET_NODE_ACTIVATION_FAILED), so it reached it over TLS and was refused."""
        stack = self.stack("tls")
        topology = compose_topology(tls=True, num_supernodes=NODES + 1)
        keys = f"/app/certs/supernode-{NODES}"
        command = supernode_command(topology, NODES)[len(supernode_entry_point(topology)) :]  # the service's own
        log = stack.log("unregistered")
        try:
            done = stack.compose(
                "run",
                "--rm",
                "--no-deps",
                "-T",
                "-v",
                f"{stack.certs}/supernode-{NODES}:{keys}:ro",
                "supernode-0",
                *command,
                limit_s=300,
                log=log,
            )
        except subprocess.TimeoutExpired:
            raise StepFailed("the unregistered SuperNode was still running after 300 s") from None
        if done.returncode == 0:
            raise StepFailed("the unregistered SuperNode exited 0")
        refusal = next(
            (
                line
                for line in log.read_text(errors="replace").splitlines()
                if "[code: 2004] Failed to activate SuperNode" in line
            ),
            None,
        )
        if refusal is None:
            raise StepFailed(
                f"exit {done.returncode} without '[code: 2004] Failed to activate SuperNode': {log_tail(log, 5)}"
            )
        online = online_supernodes(stack.cli_environment)
        if online != NODES:
            raise StepFailed(f"{online} SuperNodes online, expected {NODES}")
        refused = refusal[refusal.index("[code: 2004]") :][:80]
        return f"refused by the SuperLink: exit {done.returncode}, '{refused}'; still {online} online"

    def tls_run(self) -> str:
        run = self.start_run(self.stack("tls"), "compose-tls", NODES)
        run.finish(self.settings.run_timeout_s)
        accuracy = final_accuracy(self.work / "results" / run.name)
        plain = f"{self.plain_accuracy:.4f}" if self.plain_accuracy is not None else "?"
        return (
            f"run {run.run_id} completed over TLS; final accuracy {accuracy:.4f} (plain stack: {plain}); "
            f"{self.stack('tls').served_by_warm_processes()}"
        )

    def run(self) -> None:
        """Every scenario in order; the stacks are down and the log streams stopped however it ends."""
        settings, step = self.settings, self.recorder.step
        for group in sorted(settings.skip):
            self.recorder.note(f"skipped (SKIP): {group}")
        try:
            step(f"plain stack: up, {NODES} SuperNodes online", self.stack("plain").up, critical=True)
            step(f"plain stack: run, {settings.rounds} rounds on digits (MLP), seed {settings.seed}", self.plain_run)
            if "kill" not in settings.skip:
                step(
                    f"plain stack: SuperNode killed after round 1 of {settings.kill_rounds}, run still completes",
                    self.kill_supernode,
                )
            step("plain stack: down -v", self.stack("plain").down, critical=True)
            if "loopback" not in settings.skip:
                step(
                    "loopback python -m alignfl.fl_app.deploy (./scripts/deploy.sh), same seed and run config: "
                    "accuracy compared",
                    self.loopback,
                )
            if "tls" not in settings.skip:
                step(f"TLS + SuperNode auth stack: up, {NODES} SuperNodes online", self.tls_up, critical=True)
                step("TLS stack: SuperNode with an unregistered key is refused", self.tls_unregistered)
                step(f"TLS stack: run, {settings.rounds} rounds", self.tls_run)
                step("TLS stack: down -v", self.stack("tls").down, critical=True)
        except CheckEnded:
            pass
        finally:
            self.clean_up()

    def clean_up(self) -> None:
        """Stop the log streams; take down what an early end left (both files: every service of both stacks)."""
        stop_processes([run.stream for run in self.runs], grace_s=5.0)
        if project_leftovers():
            start = time.monotonic()
            self.stack("tls").compose(
                "down", "-v", "--remove-orphans", "--timeout", "10", log=self.work / "logs" / "down-cleanup.log"
            )
            left = project_leftovers()
            self.recorder.record(
                Step(
                    "FAIL" if left else "PASS",
                    round(time.monotonic() - start),
                    "cleanup: down -v",
                    f"left: {' '.join(left)}" if left else "stacks removed after an early end",
                )
            )


def parse_args(argv: Sequence[str] | None) -> Settings:
    parser = argparse.ArgumentParser(prog="tests/compose_scenarios.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, required=True, help="logs, results and keys go here")
    parser.add_argument(
        "--rounds",
        type=int,
        default=Settings.rounds,
        help=f"rounds of the plain, loopback and TLS runs (default {Settings.rounds})",
    )
    parser.add_argument("--seed", type=int, default=Settings.seed)
    parser.add_argument(
        "--run-timeout",
        type=float,
        default=Settings.run_timeout_s,
        help=f"seconds a run may take before it is stopped as hung (default {Settings.run_timeout_s})",
    )
    parser.add_argument(
        "--kill-min-nodes",
        type=int,
        default=Settings.kill_min_nodes,
        help=f"min-available-nodes of the node-kill run (default {Settings.kill_min_nodes})",
    )
    parser.add_argument(
        "--kill-rounds",
        type=int,
        default=Settings.kill_rounds,
        help=f"rounds of the node-kill run, at least 2 (default {Settings.kill_rounds})",
    )
    parser.add_argument(
        "--compare-tol",
        type=float,
        default=Settings.compare_tol,
        help=f"largest accepted |compose - loopback| final accuracy (default {Settings.compare_tol})",
    )
    parser.add_argument("--skip", default="", help=f"step groups to leave out, any of: {' '.join(STEP_GROUPS)}")
    args = parser.parse_args(argv)
    skip = frozenset(args.skip.split())
    checks = [
        (args.rounds >= 1, f"--rounds={args.rounds}: must be at least 1"),
        (args.run_timeout > 0, f"--run-timeout={args.run_timeout}: must be positive"),
        (
            1 <= args.kill_min_nodes <= NODES,
            f"--kill-min-nodes={args.kill_min_nodes}: must lie in 1..{NODES} (round 1 "
            "waits for them; later rounds go on without the killed node)",
        ),
        (args.kill_rounds >= 2, f"--kill-rounds={args.kill_rounds}: must be at least 2 (a round after the kill)"),
        (args.compare_tol >= 0, f"--compare-tol={args.compare_tol}: must be >= 0"),
        (skip <= set(STEP_GROUPS), f"--skip={args.skip!r}: allowed are {', '.join(STEP_GROUPS)}"),
    ]
    problems = [message for ok, message in checks if not ok]
    if problems:
        parser.error("; ".join(problems))
    return Settings(
        args.work_dir.resolve(),
        args.rounds,
        args.seed,
        args.run_timeout,
        args.kill_min_nodes,
        args.kill_rounds,
        args.compare_tol,
        skip,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """0 when every step passed, 1 when one failed, 128 + the signal's number when stopped."""
    settings = parse_args(argv)
    (settings.work / "logs").mkdir(parents=True, exist_ok=True)
    recorder = Recorder(settings.work / "steps.tsv")
    try:
        with stop_signals():
            ComposeCheck(settings, recorder).run()
    except Stopped as stop:
        print(f"[compose-check] stopped by {stop}; the stacks are down", file=sys.stderr)
        return stop.exit_code
    return 1 if recorder.failed or not recorder.steps else 0


if __name__ == "__main__":
    sys.exit(main())
