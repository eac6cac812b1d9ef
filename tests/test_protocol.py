"""FedMA's published protocol as a preset (``fedma-protocol``, ``fedma-protocol-cpu``): what each of its jobs runs,
the keys it fixes, and its report (accuracy against communication rounds)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from alignfl.fl_app.sweeps.configs import register_configs
from alignfl.fl_app.sweeps.fixed import fixed_key_problem
from alignfl.fl_app.sweeps.sweep import job_settings, sweep_job_overrides
from tests.sweep_jobs import CONF, command_in_process, composed, fake_job

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import protocol_report

PRESET = "+experiment=fedma-protocol-cpu"


def test_every_job_starts_apart_trains_the_papers_regime_and_fedma_counts_cycles(tmp_path):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        preset = compose("config", overrides=[PRESET], return_hydra_config=True)
        jobs = [job for job in sweep_job_overrides(preset) if "seed=0" in job]
    settings = {}
    for overrides in jobs:
        job = composed(overrides)
        config, sim = job_settings(job, job.hydra.runtime.choices, tmp_path)
        method = next(o.split("=")[1] for o in overrides if o.startswith("experiment/protocol_method="))
        settings[method] = config
        assert (config.client_init, config.local_epochs, config.fraction_train) == ("independent", 20, 1.0)
        assert (config.dataset, config.train_size, sim.num_supernodes) == ("fashion-mnist", 0, 16)
    assert len(settings) == 9
    assert settings["fedma"].num_server_rounds == 10 * 5 and settings["fedma"].settings.fedma_retrain_epochs == 20
    assert {settings[m].num_server_rounds for m in settings if m != "fedma"} == {10}
    references = {m: c.settings.matched_reference for m, c in settings.items() if c.strategy == "matched"}
    assert references == {
        "matched": "global",
        "matched-client": "client",
        "matched-iterative": "iterative",
        "matched-universe": "universe",
    }
    assert settings["matched-iterative"].settings.matched_iterative_start == "client"
    assert settings["otfusion-client"].settings.otfusion_reference == "client"


@pytest.mark.parametrize("override", ["train.client_init=global", "train.fraction_train=0.5"])
def test_an_override_that_contradicts_the_protocol_is_named(override):
    problem = fixed_key_problem(composed([PRESET, override]))
    key = override.partition("=")[0]
    assert problem is not None and override in problem and "'fedma-protocol-cpu'" in problem and key in problem
    assert fixed_key_problem(composed([PRESET, "train.lr=0.02"])) is None  # a key the protocol leaves free
    assert fixed_key_problem(composed([PRESET, "train.lr=${nope.x}"])) is None  # read as typed, not resolved
    assert fixed_key_problem(composed([override])) is None  # no preset, nothing fixed


def test_the_sweep_refuses_such_an_override_in_one_line_before_any_job(tmp_path, capfd):
    result = command_in_process(capfd, "-m", PRESET, "train.client_init=global", f"hydra.sweep.dir={tmp_path}")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "refused" in line]
    assert len(lines) == 1 and "train.client_init=global contradicts preset 'fedma-protocol-cpu'" in lines[0]
    assert not list(tmp_path.glob("**/.hydra")), "no job started"


def _job(
    folder_root: Path, method: str, seed: int, accuracies: list[float], between: float, own: dict | None = None
) -> None:
    folder = folder_root / f"experiment/protocol_method={method}" / f"seed={seed}"
    fake_job(folder, [f"experiment/protocol_method={method}", f"seed={seed}"], "completed", final=accuracies[-1])
    run = folder / "run"
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "run-folder": str(run)}))
    rows = [{"round": r, "accuracy": a} for r, a in enumerate(accuracies)]
    rows[1]["client-units-moved-between"] = {"hidden.0": between, "hidden.1": 0.0}
    for row in rows[1:]:
        row.update(own or {})
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_the_report_reads_fedmas_accuracy_at_the_end_of_each_cycle(tmp_path):
    for seed in (0, 1):
        _job(tmp_path, "fedavg", seed, [0.1, 0.2 + seed / 10, 0.5], between=0.9)
    _job(tmp_path, "fedma", 0, [0.1, 0.3, 0.3, 0.4, 0.6, 0.7], between=0.5)  # 2 cycles of 2 stages (+ round 5)
    _job(tmp_path, "otfusion", 0, [0.1, 0.4, 0.6], between=0.5, own={"transport-off-diagonal": {"h0": 0.4, "h1": 0.2}})
    assert protocol_report.main([str(tmp_path), "--stages", "2"]) == 0
    text = (tmp_path / "protocol.md").read_text()
    assert "| fedavg | 2 | 10.0 ± 0.0 | 25.0 ± 7.1 | 50.0 ± 0.0 | 45.0 |" in text
    assert "| fedma | 1 | 10.0 | 30.0 | 60.0 | 25.0 |" in text
    # OT fusion's own moves: its maps' mass off the diagonal, round 1 and the later rounds (here 30 % in both)
    assert "| otfusion | 1 | 10.0 | 40.0 | 60.0 | 25.0 | – | – | 30.0 | 30.0 |" in text
    assert (tmp_path / "protocol.png").stat().st_size > 0


def test_the_report_refuses_a_folder_without_a_protocol_job(tmp_path, capsys):
    fake_job(tmp_path / "other" / "seed=0", ["train.lr=0.1", "seed=0"], "completed")
    with pytest.raises(SystemExit) as exit_:
        protocol_report.main([str(tmp_path)])
    assert exit_.value.code == 2 and "no finished job of the protocol preset" in capsys.readouterr().err
