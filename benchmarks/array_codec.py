"""What a message's model costs to write and read: Flower's own ``.npy`` coding against alignfl's.

Every training reply carries the client's model as an ArrayRecord, and the server reads every reply's arrays.
Flower makes each array with ``np.save`` and reads it with ``np.load``, which format and parse a header in
Python per array; alignfl makes the header once per dtype and shape (:func:`alignfl.core.model_io.arrays_of`)
and reads the data as a view (:func:`alignfl.core.model_io.array_values`). For each model of the cross-device
benchmark, the median time per message of writing (state dict → ArrayRecord), reading (ArrayRecord → arrays:
the server's check and mean) and reading as tensors (a client loading the model it received), both ways,
interleaved, one thread:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/array_codec.py
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
from benchutil import machine, median
from flwr.app import ArrayRecord

from alignfl.core.model_io import array_values, arrays_of, build_model_for, federated_state, tensors_of
from alignfl.fl_app.config import parse_run_config

MODELS = ("twonn", "mlp", "twocnn")


def per_call(run: Callable[[], object], calls: int) -> float:
    began = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - began) / calls


def measure(model_name: str, calls: int, repeats: int) -> dict[str, float]:
    """Median seconds per message of each way for ``model_name``'s federated state."""
    config = parse_run_config({"model": model_name, "dataset": "fashion-mnist"})
    state = {k: v.detach() for k, v in federated_state(build_model_for(config, (1, 28, 28), 10)).items()}
    record = ArrayRecord(state)
    ways = {
        "write, Flower": lambda: ArrayRecord(state),
        "write, alignfl": lambda: arrays_of(state),
        "read, Flower": lambda: [a.numpy() for a in record.values()],
        "read, alignfl": lambda: [array_values(a) for a in record.values()],
        "tensors, Flower": record.to_torch_state_dict,
        "tensors, alignfl": lambda: tensors_of(record),
    }
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(repeats):
        for way, run in ways.items():
            times[way].append(per_call(run, calls))
    return {way: median(values) for way, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="messages timed together")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{machine()}; load before {os.getloadavg()}")
    columns = ("write", "read", "tensors")
    print("| model | arrays | MB | " + " | ".join(f"{c}, Flower ms | {c}, alignfl ms" for c in columns) + " |")
    print("|---|---|---|" + "---|---|" * len(columns))
    for name in MODELS:
        config = parse_run_config({"model": name, "dataset": "fashion-mnist"})
        state = federated_state(build_model_for(config, (1, 28, 28), 10))
        size = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
        ms = {way: 1e3 * seconds for way, seconds in measure(name, args.calls, args.repeats).items()}
        cells = " | ".join(f"{ms[f'{c}, Flower']:.3f} | {ms[f'{c}, alignfl']:.3f}" for c in columns)
        print(f"| {name} | {len(state)} | {size:.1f} | {cells} |")
    print(f"load after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
