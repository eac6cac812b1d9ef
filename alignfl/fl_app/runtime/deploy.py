"""docker-compose.yml's deployment as local processes on 127.0.0.1: run one experiment on it.

``python -m alignfl.fl_app.deploy`` checks its options and the run config before anything
starts, starts the services of :func:`alignfl.fl_app.runtime.topology.loopback_topology` (with
``--tls``: TLS everywhere and SuperNode authentication, keys from
``scripts/make_certs.sh``) as a :class:`alignfl.fl_app.runtime.deployment.Deployment`, which waits
until every SuperNode is online, submits the run with ``flwr run``, streams its
log, reads its final status, and stops every process it started by process id,
also on Ctrl-C, SIGTERM, SIGHUP or failure. Its exit code is the run's outcome.
When the SuperLink exits mid-run, the command that continues the run from its
checkpoint (``resume-from``) is printed. The services' logs go to the run folder
(``logs/``; :func:`alignfl.fl_app.runtime.deployment.run_logs`) and their Flower homes to a
temporary folder removed however the deployment ends, unless ``--work-dir`` keeps both.

    python -m alignfl.fl_app.deploy --num-supernodes 3 --run-config 'dataset="digits" num-server-rounds=2'

``--executor`` picks how the SuperNodes start ClientApp processes: ``warm`` (the
default, each forked from a warm parent: :mod:`alignfl.fl_app.patches.warm_superexec`) or ``flower``
(Flower's own, a fresh ``flwr-clientapp`` per message). ``--node-poll`` is how often an
idle SuperNode asks for a message (:mod:`alignfl.fl_app.patches.polling_supernode`; ``flower``: every 3 s).

``python -m alignfl.fl_app.deploy register ...`` is :mod:`alignfl.fl_app.runtime.register` (compose.tls.yml's
one-shot service that registers SuperNode public keys); ``python -m alignfl.fl_app.deploy
superlink|supernodes ...`` runs one machine's part of a deployment across machines
(:mod:`alignfl.fl_app.runtime.roles`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from alignfl.core.data import DatasetMissingError
from alignfl.fl_app.config import ConfigError, RunConfig
from alignfl.fl_app.locations import checkout_root, program
from alignfl.fl_app.patches.polling_supernode import FLOWER_NODE_POLL_S
from alignfl.fl_app.runtime import register
from alignfl.fl_app.runtime.common import check_folder, made_folder, work_folder
from alignfl.fl_app.runtime.deployment import deployment, resume_advice, run_logs
from alignfl.fl_app.runtime.flwr_cli import parse_overrides
from alignfl.fl_app.runtime.keys import default_certs, refuse_committable_folder, refuse_exposed_keys
from alignfl.fl_app.runtime.launch import prepare_config, report_outcome
from alignfl.fl_app.runtime.processes import Stopped, stop_signals
from alignfl.fl_app.runtime.roles import role_main
from alignfl.fl_app.runtime.topology import (
    COMPOSE_NUM_SUPERNODES,
    add_node_options,
    add_superlink_db_option,
    check_superlink_db,
    loopback_topology,
    make_certificates,
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["register"]:  # compose.tls.yml's supernode-register service
        return register.main(argv[1:])
    if argv[:1] in (["superlink"], ["supernodes"]):
        return role_main(argv[0], argv[1:])
    parser = argparse.ArgumentParser(prog=program("alignfl.fl_app.deploy"), description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--num-supernodes",
        type=int,
        default=COMPOSE_NUM_SUPERNODES,
        help=f"SuperNodes, one partition each (default {COMPOSE_NUM_SUPERNODES}, as in the compose file)",
    )
    parser.add_argument("--run-config", default="", help="'key=value ...' overrides of [tool.flwr.app.config]")
    parser.add_argument("--rounds", type=int, help="shorthand for the run-config key num-server-rounds")
    parser.add_argument(
        "--tls",
        action="store_true",
        help="TLS on every API and SuperNode authentication (keys registered before nodes start)",
    )
    parser.add_argument(
        "--certs",
        type=Path,
        help=f"make_certs.sh's folder for --tls, missing files made there (default {default_certs()}, outside the "
        "checkout)",
    )
    add_node_options(parser)
    add_superlink_db_option(parser)
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="where the services' logs and Flower homes go, and stay (default: the logs in the run folder's logs/, "
        "the homes in a temporary folder removed when the deployment ends)",
    )
    args = parser.parse_args(argv)
    config = None
    try:
        with stop_signals():
            try:
                config = prepare(args)
            except (ValueError, DatasetMissingError) as error:  # ConfigError is a ValueError
                print(f"[alignfl] refused before starting: {error}", file=sys.stderr)
                return 2
            return deploy_and_run(config, args)
    except Stopped as stop:
        advice = ""
        if config is not None:
            advice = f"; {resume_advice(config, args.num_supernodes, args.tls, args.executor, args.node_poll)}"
        print(f"[alignfl] stopped by {stop}: every process of the deployment has been stopped{advice}", file=sys.stderr)
        return stop.exit_code


def prepare(args: argparse.Namespace) -> RunConfig:
    """Check the options and the run config before anything starts."""
    if args.certs is not None and not args.tls:
        raise ValueError("--certs is only used with --tls")
    for option, folder in (("--work-dir", args.work_dir), ("--certs", args.certs)):
        if folder is not None:
            check_folder(option, folder.resolve())
    check_superlink_db(args.superlink_db)
    refuse_exposed_keys(checkout_root(), (args.certs or default_certs()) if args.tls else None)
    if args.tls:
        refuse_committable_folder("--certs", args.certs or default_certs())
    if args.rounds is not None and args.rounds < 1:  # named as the user wrote it, not as num-server-rounds
        raise ConfigError(f"--rounds must be at least 1, got {args.rounds}")
    overrides = parse_overrides(args.run_config)
    if args.rounds is not None:
        overrides["num-server-rounds"] = args.rounds
    return prepare_config(overrides, args.num_supernodes)


def deploy_and_run(config: RunConfig, args: argparse.Namespace) -> int:
    """Start the deployment, run the experiment on it, stop everything; the exit code."""
    certs = None
    if args.tls:
        try:
            certs = make_certificates((args.certs or default_certs()).resolve(), args.num_supernodes)
        except ConfigError as error:  # make_certs.sh's refusal, of a folder that changed since it was checked
            print(f"[alignfl] refused before starting: {error}", file=sys.stderr)
            return 2
        except RuntimeError as error:
            print(f"[alignfl] deployment FAILED: {error}", file=sys.stderr)
            return 1
    with work_folder(args.work_dir, "alignfl-deploy-") as work, made_folder(logs_folder(config, args)) as logs:
        print(
            f"[alignfl] deployment on 127.0.0.1: {args.num_supernodes} SuperNodes, "
            f"{'TLS + SuperNode authentication' if args.tls else 'plaintext'}, {args.executor} ClientApp executor, "
            f"SuperNodes polling every {args.node_poll or FLOWER_NODE_POLL_S:g} s; logs in {logs}",
            flush=True,
        )
        try:
            topology = loopback_topology(
                args.num_supernodes,
                work,
                certs,
                args.executor,
                args.node_poll,
                args.superlink_db.resolve() if args.superlink_db else None,
            )
            with deployment(topology, work, logs) as running:
                status, details = running.run(config)
        except (RuntimeError, TimeoutError) as error:
            print(f"[alignfl] deployment FAILED: {error}", file=sys.stderr)
            return 1
    code = report_outcome(config, status, details)
    if running.exited and status != "aborted":
        print(
            "[alignfl] services that exited during the run: "
            + ", ".join(f"{name} ({how})" for name, how in running.exited.items())
            + f"; their logs are in {logs}",
            file=sys.stderr,
        )
    return code


def logs_folder(config: RunConfig, args: argparse.Namespace) -> Path:
    """``logs`` of ``--work-dir``, which then also keeps the services' Flower homes; without it the run folder's
    (:func:`alignfl.fl_app.runtime.deployment.run_logs`), and the homes are removed with their temporary folder."""
    return args.work_dir.resolve() / "logs" if args.work_dir is not None else run_logs(config)


if __name__ == "__main__":
    sys.exit(main())
