"""Server-side aggregation cost per round of every registered strategy, at K clients.

For each strategy and K, a fresh server side is built from the run context and plans round 1
(``plan_train`` for K nodes), and each of the K training messages gets an authentic reply built by the
strategy's own client update, as the ClientApp builds it: ``train`` on a
few random examples (so SCAFFOLD's control update, FedMA's class counts, Ψ-Net's held groups are
there), then the model is replaced by a synthetic "trained" client model (the global model with its
hidden units randomly permuted and Gaussian noise added, so matching has real work) before
``model_record``. Only ``aggregate`` is timed (the round runner's reply checks excluded): the median of
``--repeats`` runs, each on a fresh server side and fresh replies.

Round 1 is what is timed: FedMA's first round matches only the first layer of its schedule, so its
later rounds cost a different amount. Ψ-Net needs a Ψ-Net model and runs with ``psi-vgg9`` in the
"vgg9" column (and is left out of the "mlp" one).

    flock /tmp/alignfl-exp.lock env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/aggregation_cost.py
    .venv/bin/python benchmarks/aggregation_cost.py --models mlp --clients 10 --repeats 3
"""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from benchutil import append_jsonl, machine, median, read_jsonl, write_report
from flwr.app import ConfigRecord, Context, MetricRecord, RecordDict

from alignfl.core.data import ClientData, dataset_info
from alignfl.core.model_io import build_run_model, federated_state, load_arrays, to_arrays
from alignfl.core.rounds.strategy import Reply, ServerStrategy
from alignfl.fl_app.config import RunConfig, build_context, parse_run_config
from alignfl.models import permute_state, random_permutations
from alignfl.strategies import get_strategy, list_strategies

MODEL_FOR = {"mlp": {"psinet": None}, "vgg9": {"psinet": "psi-vgg9"}}
"""Per benchmark model, the strategies that need another model (None: left out)."""


class _Dataset:
    """What build_run_model reads of a dataset, without loading one."""

    def __init__(self, name: str) -> None:
        self.input_shape, self.num_classes = dataset_info(name)


def synthetic_client_states(config: RunConfig, clients: int, seed: int) -> tuple[torch.nn.Module, list[dict]]:
    """The global model, and K client models: its hidden units permuted at random, plus N(0, 0.01²) noise."""
    model = build_run_model(config, _Dataset(config.dataset))
    spec, state = model.permutation_spec(), federated_state(model)
    generator = torch.Generator().manual_seed(seed)
    states = []
    for _ in range(clients):
        permuted = permute_state(spec, state, random_permutations(spec, state, generator))
        states.append({k: v + 0.01 * torch.randn(v.shape, generator=generator) for k, v in permuted.items()})
    return model, states


def replies(config: RunConfig, server: ServerStrategy, model: torch.nn.Module, states: list[dict]) -> list[Reply]:
    """Round 1's training messages for K nodes, answered by the strategy's client update."""
    global_arrays = to_arrays(model)
    nodes = list(range(1, len(states) + 1))
    contents = server.plan_train(
        1,
        global_arrays,
        ConfigRecord({**config.pan_signature(), "server-round": 1}),
        lambda: nodes,
        SimpleNamespace(trainable=lambda: nodes),
    )
    (channels, height, width), num_classes = dataset_info(config.dataset)
    generator = torch.Generator().manual_seed(0)
    answers = []
    for index, ((node, content), state) in enumerate(zip(contents.items(), states)):
        context = Context(
            run_id=1,
            node_id=node,
            node_config={"partition-id": index, "num-partitions": len(states)},
            state=RecordDict(),
            run_config={},
        )
        load_arrays(model, content["arrays"])
        x = torch.randn(8, channels, height, width, generator=generator)
        y = torch.randint(0, num_classes, (8,), generator=generator)
        update = get_strategy(config.strategy).client(config, context, content)
        metrics = update.train(model, x, y, generator, torch.device("cpu"))
        model.load_state_dict(state, strict=False)
        reply = RecordDict(
            {
                "arrays": update.model_record(model),
                **update.reply_records(ClientData(x, y, x, y)),
                "metrics": MetricRecord({**metrics, "num-examples": 100 + index, "partition-id": index}),
            }
        )
        answers.append(Reply(node, index, reply, 100.0 + index))
    return answers


def aggregation_seconds(config: RunConfig, clients: int, repeats: int) -> list[float]:
    """``repeats`` timings of round 1's ``aggregate`` on fresh server sides and replies."""
    seconds = []
    for repeat in range(repeats):
        model, states = synthetic_client_states(config, clients, seed=repeat)
        server = get_strategy(config.strategy).server(build_context(config, model))
        answers = replies(config, server, model, states)
        started = time.perf_counter()
        merge = server.aggregate(1, answers, to_arrays(model))
        seconds.append(time.perf_counter() - started)
        if merge is None:
            raise RuntimeError(f"strategy {config.strategy} aggregated nothing from {clients} synthetic replies")
    return seconds


def report(rows: list[dict[str, Any]]) -> str:
    """One row per strategy, one column per (model, K): median seconds (min-max)."""
    columns = sorted({(row["model"], row["clients"]) for row in rows}, key=lambda c: (c[0] != "mlp", c[0], c[1]))
    by_key = {(row["strategy"], row["model"], row["clients"]): row for row in rows}
    lines = [
        "| strategy | " + " | ".join(f"{model} K={k} (s)" for model, k in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for name in sorted({row["strategy"] for row in rows}):
        cells = []
        for model, k in columns:
            row = by_key.get((name, model, k))
            cells.append(
                "–"
                if row is None
                else f"{median(row['seconds']):.3f} ({min(row['seconds']):.3f}–{max(row['seconds']):.3f})"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODEL_FOR), default=["mlp"])
    parser.add_argument("--clients", nargs="+", type=int, default=[10, 100])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--strategies", nargs="+", default=None, help="default: every registered strategy")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for rows.jsonl and report.md (default: a new one under ~/alignfl-results); "
        "an existing folder is resumed: measured cells are not run again",
    )
    args = parser.parse_args(argv)
    names = args.strategies or list_strategies()
    unknown = sorted(set(names) - set(list_strategies()))
    if unknown:
        parser.error(f"unknown strategies {unknown}; allowed: {list_strategies()}")
    if args.repeats < 1 or min(args.clients) < 2:
        parser.error(f"--repeats must be >= 1 and every --clients >= 2, got {args.repeats} and {args.clients}")
    torch.set_num_threads(1)
    out = (
        args.out or Path.home() / "alignfl-results" / "benchmarks" / f"aggregation-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    ).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    done = {(row["strategy"], row["model"], row["clients"]) for row in read_jsonl(rows_path)}
    print(f"[aggregation] {machine()}; results in {out}", flush=True)
    for base_model in args.models:
        for clients in args.clients:
            for name in names:
                model = MODEL_FOR[base_model].get(name, base_model)
                if model is None or (name, base_model, clients) in done:
                    continue
                config = parse_run_config(
                    {"strategy": name, "model": model, "dataset": "fashion-mnist", "min-available-nodes": clients}
                )
                seconds = aggregation_seconds(config, clients, args.repeats)
                append_jsonl(
                    rows_path,
                    {
                        "strategy": name,
                        "model": base_model,
                        "run-model": model,
                        "clients": clients,
                        "seconds": seconds,
                        "machine": machine(),
                    },
                )
                print(f"[aggregation] {name} {model} K={clients}: median {median(seconds):.3f} s", flush=True)
    return write_report(out, rows_path, report)


if __name__ == "__main__":
    raise SystemExit(main())
