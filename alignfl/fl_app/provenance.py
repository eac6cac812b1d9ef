"""Where a run's figures came from: the project's commit (also where the code runs from a copy) and the machine.

``flwr run`` ships the project to its ServerApp and ClientApps as a FAB, installed outside any git checkout, so
the code cannot ask git where it came from. The launcher and the deployment, which run in the checkout, put the
commit into the environment of every Flower process they start (:data:`COMMIT_ENV`, read first by
:func:`git_commit`).

The same code gives other floats on another CPU: float kernels round differently with and without AVX-512, and
torch's thread count changes the order of its sums, so a figure is only reproducible on a machine that says what
it was (:func:`machine`).
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

from alignfl.fl_app.locations import checkout_root

COMMIT_ENV = "ALIGNFL_GIT_COMMIT"
UNKNOWN = "unknown"
CPUINFO = Path("/proc/cpuinfo")
VECTOR_FLAG = re.compile(r"^(avx|amx)")
"""The CPU flags that pick float kernels: AVX, AVX2, the AVX-512 family, AMX."""


def checkout_commit(folder: Path | None = None) -> str:
    """The commit checked out where ``folder`` is (default: the checkout alignfl runs from), or ``unknown``
    outside a git checkout (an installed alignfl, even in a virtual environment inside another project's
    checkout), or without git."""
    folder = folder or checkout_root()
    if folder is None:
        return UNKNOWN
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return UNKNOWN
    return done.stdout.strip() if done.returncode == 0 else UNKNOWN


def git_commit() -> str:
    """The project's commit: the one its launcher passed on (:data:`COMMIT_ENV`), else this code's checkout's."""
    return os.environ.get(COMMIT_ENV) or checkout_commit()


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name, with its family and model numbers (a virtual machine may show only "AMD EPYC")."""
    fields = _cpuinfo_fields(cpuinfo)
    name = fields.get("model name") or platform.processor() or platform.machine() or UNKNOWN
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


def vector_extensions(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's AVX/AMX flags, space-separated (``avx avx2 avx512f ...``), or ``unknown`` without /proc/cpuinfo."""
    flags = _cpuinfo_fields(cpuinfo).get("flags")
    if flags is None:
        return UNKNOWN
    return " ".join(sorted(flag for flag in flags.split() if VECTOR_FLAG.match(flag))) or "none"


def _cpuinfo_fields(cpuinfo: Path) -> dict[str, str]:
    """The first processor's ``key: value`` lines of /proc/cpuinfo (empty where there is none: not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def gpu_driver() -> str:
    """The NVIDIA driver's version from ``nvidia-smi``, or ``unknown`` (no nvidia-smi, or it fails)."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return UNKNOWN
    lines = done.stdout.split()
    return lines[0] if done.returncode == 0 and lines else UNKNOWN


def machine() -> dict[str, str | int]:
    """What a run's floats and times depend on: the CPU, its vector extensions and the kernels torch picked for
    them, the threads, and the GPU where CUDA is available (no GPU entries without it).

    Examples
    --------
    >>> machine()["torch-threads"]  # doctest: +SKIP
    1
    """
    import torch

    found: dict[str, str | int] = {
        "cpu": cpu_model(),
        "cpu-vector-extensions": vector_extensions(),
        "torch-cpu-capability": str(torch.backends.cpu.get_cpu_capability()),
        "cpus-usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0,
        "torch-threads": torch.get_num_threads(),
        "omp-num-threads": os.environ.get("OMP_NUM_THREADS", "unset"),
        "torch-version": torch.__version__,
    }
    if torch.cuda.is_available():
        found.update(
            {
                "gpu": torch.cuda.get_device_name(0),
                "gpus": torch.cuda.device_count(),
                "cuda": str(torch.version.cuda),
                "gpu-driver": gpu_driver(),
            }
        )
    return found
