"""Where a run came from (alignfl/fl_app/provenance.py): the commit, also where the code runs from an installed FAB, and
the machine."""

from __future__ import annotations

import subprocess
from pathlib import Path

from alignfl.fl_app import provenance
from alignfl.fl_app.runtime.superlink import flower_environment

PROJECT_ROOT = Path(__file__).resolve().parents[1]
"""The checkout the tests run in."""


def test_the_launchers_commit_reaches_every_flower_process_and_wins_over_the_codes_folder(tmp_path, monkeypatch):
    head = subprocess.run(["git", "-C", str(PROJECT_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    expected = head.stdout.strip() if head.returncode == 0 else provenance.UNKNOWN
    monkeypatch.delenv(provenance.COMMIT_ENV, raising=False)
    assert provenance.git_commit() == expected
    assert flower_environment(tmp_path)[provenance.COMMIT_ENV] == expected
    assert provenance.checkout_commit(tmp_path) == provenance.UNKNOWN  # a FAB's install folder: not a checkout
    monkeypatch.setenv(provenance.COMMIT_ENV, "abc123")
    assert provenance.git_commit() == "abc123"


INTEL = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw amx_tile sha_ni

processor\t: 1
model name\t: another core, never read
"""


def test_the_machine_names_its_cpu_threads_and_kernels_with_plain_values(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    found = provenance.machine()
    assert {"cpu", "cpu-vector-extensions", "torch-cpu-capability", "cpus-usable", "torch-threads"} <= set(found)
    assert all(isinstance(value, (str, int)) for value in found.values()), found
    assert found["omp-num-threads"] == "1" and found["torch-threads"] >= 1 and found["cpus-usable"] >= 1
    assert not {"gpu", "gpus", "cuda", "gpu-driver"} & set(found)  # no GPU entries without CUDA


def test_the_machine_names_its_gpu_where_cuda_is_available_also_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda index=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    monkeypatch.setenv("PATH", "")  # no nvidia-smi: the driver is unknown, nothing fails
    found = provenance.machine()
    assert found["gpu"] == "NVIDIA H100 80GB HBM3" and found["gpus"] == 1
    assert isinstance(found["cuda"], str) and found["gpu-driver"] == provenance.UNKNOWN


def test_the_cpu_is_read_from_cpuinfo_and_unknown_without_it(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(INTEL)
    assert provenance.cpu_model(cpuinfo) == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz (family 6, model 143)"
    assert provenance.vector_extensions(cpuinfo) == "amx_tile avx avx2 avx512bw avx512f"
    missing = tmp_path / "none"
    assert provenance.vector_extensions(missing) == provenance.UNKNOWN
    assert provenance.cpu_model(missing)  # the platform's name for it, never empty
