"""Hydra sweeps: conf/ mirrors the run-config schema, bad sweeps stop before training, results are aggregated."""

import json
import os
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from alignfl.core.config import RESULTS_ENV, default_results_root
from alignfl.fl_app.config import ConfigError, default_run_config, parse_run_config
from alignfl.fl_app.sweeps.configs import SET_PER_JOB
from alignfl.fl_app.sweeps.overrides import unowned_override
from alignfl.fl_app.sweeps.resolvers import composition_problem, interpolation_problem
from alignfl.fl_app.sweeps.slurm import slurm_problem
from alignfl.fl_app.sweeps.sweep import (
    GROUPS,
    JOB_RECORD,
    ValidateSweep,
    hydra_to_run_config,
    job_settings,
    register_configs,
    run_job,
    validate_sweep,
)
from alignfl.models import list_models
from alignfl.strategies import list_strategies
from tests.sweep_jobs import CONF, TINY, command_in_process, composed, sweep


def test_hydra_configs_are_generated_with_the_schema_defaults_and_cover_every_key():
    """Compose the defaults with every strategy and every model: each key has a path, each value is its default."""
    defaults = default_run_config()
    seen = {}
    for group, names in (("strategy", list_strategies()), ("model", list_models())):
        for name in names:
            cfg = composed([f"{group}={name}"])
            seen.update(hydra_to_run_config(cfg, {**cfg.hydra.runtime.choices, group: name}))
    seen.update({key: defaults[key] for key in GROUPS})
    assert sorted([*seen, *SET_PER_JOB]) == sorted(defaults)
    assert seen == {key: defaults[key] for key in seen}


def test_hydra_overrides_become_the_validated_run_config(tmp_path):
    cfg = composed(
        [
            "strategy=fedprox",
            "strategy.fedprox_mu=0.1",
            "pan.mode=mul",
            "pan.t=4",
            "pan.a=0.05",
            "data.dirichlet_alpha=0.1",
            "seed=1",
            "sim.num_supernodes=7",
        ]
    )
    config, sim = job_settings(cfg, cfg.hydra.runtime.choices, tmp_path)
    assert (config.strategy, config.settings.fedprox_mu, config.pan_mode, config.pan_t, config.pan_a) == (
        "fedprox",
        0.1,
        "mul",
        4.0,
        0.05,
    )
    assert (config.partitioner_settings.dirichlet_alpha, config.seed, config.min_available_nodes) == (0.1, 1, 7)
    assert (config.results_dir, config.run_name) == (str(tmp_path.resolve()), "run")
    assert (sim.num_supernodes, sim.backend, sim.vectorise) == (7, "batched", "auto")
    assert sim.federation_config() == {
        "num-supernodes": 7,
        "client-resources-num-cpus": 1,
        "client-resources-num-gpus": 0.0,
    }


def test_sweeps_write_under_the_results_root_of_every_run(monkeypatch, tmp_path):
    """A sweep, one job or many, is a folder of ``<root>/sweeps/`` under the launcher's root."""
    for env in (str(tmp_path / "root"), None):
        if env is None:
            monkeypatch.delenv(RESULTS_ENV, raising=False)
        else:
            monkeypatch.setenv(RESULTS_ENV, env)
        cfg = composed()
        for folder in (cfg.hydra.run.dir, cfg.hydra.sweep.dir):
            assert Path(folder).parent == default_results_root() / "sweeps"


@pytest.mark.parametrize(
    ("partitioner", "path", "value"),
    [
        ("dirichlet", "data.dirichlet_alpha", 0.1),
        ("pathological", "data.classes_per_client", 3),
        ("shard", "data.shards_per_client", 3),
        ("fixed-pairs", "data.samples_per_client", 20),
    ],
)
def test_a_partitioners_settings_sit_in_the_data_section(tmp_path, partitioner, path, value):
    cfg = composed([f"data.partitioner={partitioner}", f"{path}={value}"])
    config, _ = job_settings(cfg, cfg.hydra.runtime.choices, tmp_path)
    assert config.partitioner == partitioner and getattr(config.partitioner_settings, path[len("data.") :]) == value
    with pytest.raises(
        ConfigError, match=f"belongs to partitioner '{partitioner}', not to the chosen partitioner 'iid'"
    ):
        cfg = composed(["data.partitioner=iid", f"{path}={value}"])
        job_settings(cfg, cfg.hydra.runtime.choices, tmp_path)


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [("pan.a=-1", "pan-a", -1), ("train.lr=0", "lr", 0), ("data.dirichlet_alpha=0", "dirichlet-alpha", 0.0)],
)
def test_a_bad_override_fails_with_the_schema_message(tmp_path, override, key, value):
    with pytest.raises(ConfigError) as schema:
        parse_run_config({key: value})
    cfg = composed([override])
    with pytest.raises(ConfigError) as error:
        job_settings(cfg, cfg.hydra.runtime.choices, tmp_path)
    assert str(error.value) == str(schema.value)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("+train.warmup=1", "'train.warmup'"),
        ("sim.num_supernodes=0", "'sim.num_supernodes' = 0"),
        ("sim.client_cpus=4 sim.ray_cpus=2", "sim.client_cpus"),
        ("sim.client_cpus=0.5", "sim.client_cpus"),
        ("sim.ray_gpus=1.5", "sim.ray_gpus"),
    ],
)
def test_keys_outside_the_schema_are_checked_too(tmp_path, override, fragment):
    cfg = composed(override.split())
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        job_settings(cfg, cfg.hydra.runtime.choices, tmp_path)


@pytest.mark.parametrize(
    ("sweep_override", "key", "value"),
    [("pan.a=0,-1", "pan-a", -1), ("data.dirichlet_alpha=0.5,0", "dirichlet-alpha", 0.0)],
)
def test_every_job_of_a_sweep_is_validated_before_it_runs(sweep_override, key, value):
    with pytest.raises(ConfigError) as schema:
        parse_run_config({key: value})
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=TINY, return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.overrides.task = [*TINY, sweep_override, "seed=0,1"]
        with pytest.raises(ConfigError) as error:
            validate_sweep(cfg)
        assert str(schema.value) in str(error.value)
        with open_dict(cfg):
            cfg.hydra.overrides.task = [*TINY, "pan.a=0,0.1", "strategy=fedavg,fedprox", "seed=0,1"]
        assert len(validate_sweep(cfg)) == 8


def _without_hydra(config) -> dict:
    """A composed config's values, resolved, its hydra section aside (it needs a running Hydra to resolve)."""
    from omegaconf import OmegaConf

    return {
        key: OmegaConf.to_container(config[key], resolve=True) if OmegaConf.is_config(config[key]) else config[key]
        for key in config
        if key != "hydra"
    }


def test_jobs_that_differ_in_the_seed_alone_are_composed_as_hydra_composes_them():
    """validate_sweep composes a configuration once and sets the other seeds on a copy: the same configs as
    Hydra's composition of each job (the hydra section aside), and a bad seed is still refused."""
    from hydra.core.global_hydra import GlobalHydra

    from alignfl.fl_app.sweeps.sweep import composed_jobs, sweep_job_overrides

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=TINY, return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.overrides.task = [*TINY, "strategy=fedavg,fedprox", "train.lr=0.1", "seed=0,1,2"]
        jobs = sweep_job_overrides(cfg)
        loader = GlobalHydra.instance().config_loader()
        reused = 0
        for overrides, job in composed_jobs(cfg, jobs):
            hydras = loader.load_sweep_config(cfg, overrides)
            assert _without_hydra(job) == _without_hydra(hydras)
            assert job.hydra.runtime.choices == hydras.hydra.runtime.choices
            reused += job.hydra.overrides.task != hydras.hydra.overrides.task
        assert len(jobs) == 6 and reused == 4, "seeds 1 and 2 of each strategy reuse seed 0's composition"
        with open_dict(cfg):
            cfg.hydra.overrides.task = [*TINY, "seed=0,-1"]
        with pytest.raises(ConfigError, match=r"sweep job .*seed=-1: run-config key .seed. = -1"):
            validate_sweep(cfg)


def test_a_sweep_job_resuming_an_unreadable_checkpoint_is_refused_before_any_job(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "checkpoint.pt").write_text("not a checkpoint")
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=TINY, return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.overrides.task = [*TINY, f"resume_from={tmp_path / 'old'}", "seed=0"]
        with pytest.raises(ConfigError, match=r"sweep job .*resume-from.*checkpoint.pt cannot be read"):
            validate_sweep(cfg)


def fake_slurm(folder: Path, ping: str, code: int) -> dict[str, str]:
    """An environment whose PATH has an ``sbatch`` and an ``scontrol`` whose ``ping`` says ``ping``."""
    folder.mkdir()
    (folder / "sbatch").write_text("#!/bin/sh\nexit 1\n")
    (folder / "scontrol").write_text(f"#!/bin/sh\necho '{ping}'\nexit {code}\n")
    for tool in ("sbatch", "scontrol"):
        (folder / tool).chmod(0o755)
    return {"PATH": f"{folder}:{os.environ['PATH']}"}


def test_slurm_is_checked_before_a_sweep_submits_to_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert "needs SLURM's sbatch, which is not on this machine's PATH" in slurm_problem()
    monkeypatch.setenv("PATH", fake_slurm(tmp_path / "down", "Slurmctld(primary) at h1 is DOWN", 1)["PATH"])
    assert "the SLURM controller does not answer (`scontrol ping`: Slurmctld(primary) at h1 is DOWN)" in slurm_problem()
    monkeypatch.setenv("PATH", fake_slurm(tmp_path / "up", "Slurmctld(primary) at h1 is UP", 0)["PATH"])
    assert slurm_problem() is None


@pytest.mark.parametrize(
    ("arguments", "path", "fragment"),
    [
        (["sim.ray_address=127.0.0.1:1"], None, "sim.ray_address='127.0.0.1:1': no Ray cluster answers there"),
        (["resume_from=OLD"], None, "'resume-from' = 'OLD': checkpoint.pt cannot be read (UnpicklingError"),
        (["-m", "hydra/launcher=slurm", "seed=0,1"], "", "needs SLURM's sbatch"),
        (["-m", "hydra/launcher=slurm", "seed=0,1"], "down", "the SLURM controller does not answer"),
    ],
    ids=["ray-address", "corrupt-checkpoint", "no-sbatch", "no-controller"],
)
def test_a_run_or_sweep_refuses_in_one_line_what_the_launcher_refuses_before_any_folder(
    tmp_path, monkeypatch, capfd, arguments, path, fragment
):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "checkpoint.pt").write_text("not a checkpoint")
    arguments = [argument.replace("OLD", str(tmp_path / "old")) for argument in arguments]
    if path == "":  # python itself, and no sbatch
        monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    elif path:
        monkeypatch.setenv("PATH", fake_slurm(tmp_path / path, "Slurmctld(primary) at h1 is DOWN", 1)["PATH"])
    folder = "hydra.sweep.dir" if "-m" in arguments else "hydra.run.dir"
    result = command_in_process(capfd, *arguments, *TINY, f"{folder}={tmp_path / 'out'}")
    fragment = fragment.replace("OLD", str(tmp_path / "old"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip().splitlines()[-1]], result.stderr
    assert "refused before starting" in result.stderr and fragment in result.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("**/.hydra"))


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        (["strategy.fedprox_mu=0.1"], "'fedprox-mu' belongs to strategy ['fedprox'], not to strategy ['fedavg']"),
        (["strategy=fedavg,fedprox", "strategy.fedprox_mu=0.1"], "not to strategy ['fedavg']"),
        (["model=vgg9", "model.psi_groups=2"], "not to model ['vgg9']"),
        (["strategy=fedprox", "strategy.nope=1"], "no strategy has a setting 'nope'"),
        (
            ["strategy=fedavgm", "strategy.server_lr=0.5"],
            "'server-lr' was renamed; write strategy.fedavgm_server_lr (strategy=fedavgm), "
            "strategy.scaffold_server_lr (strategy=scaffold)",
        ),
    ],
)
def test_an_override_of_an_unselected_algorithms_key_names_its_owner(arguments, fragment):
    assert fragment in unowned_override(arguments)


def test_overrides_of_the_chosen_algorithm_and_model_pass():
    assert (
        unowned_override(
            ["strategy=fedprox", "strategy.fedprox_mu=0.1", "model=psi-vgg9", "model.psi_groups=2", "train.lr=0.1"]
        )
        is None
    )


def test_the_algorithm_and_model_an_experiment_preset_picks_own_its_overrides():
    """fedma-clients-cpu's FedMA row (experiment/fedma_method=fedma) picks FedMA, pans-table1-cpu picks VGG-9."""
    fedma_row = ["+experiment=fedma-clients-cpu", "experiment/fedma_method=fedma", "hydra.sweeper.params=null"]
    assert unowned_override([*fedma_row, "strategy.fedma_retrain_epochs=1"]) is None
    assert unowned_override(["+experiment=pans-table1-cpu", "model.width_factor=0.25"]) is None
    assert "not to strategy ['fedavg']" in unowned_override(
        ["+experiment=fedma-clients-cpu", "experiment/fedma_method=fedavg", "strategy.fedma_retrain_epochs=1"]
    )
    assert unowned_override(["+experiment=no-such-preset", "strategy.fedma_retrain_epochs=1"]) is None  # Hydra's


def test_an_override_of_a_key_a_presets_choice_lacks_says_what_fixes_it_there():
    """The preset, not the command line, chose the algorithm: a row of the preset picks it (fedma_method) or its
    own file does (pans-table1-cpu); the refusal says which, and what fixes the command there."""
    row = unowned_override(
        ["+experiment=fedma-clients-cpu", "experiment/fedma_method=fedavg", "strategy.fedma_retrain_epochs=1"]
    )
    assert "set strategy=" not in row
    assert (
        "not to strategy ['fedavg'], which +experiment=fedma-clients-cpu runs where its row "
        "experiment/fedma_method=fedavg picks it; to set it, run only the rows that pick fedma "
        "(experiment/fedma_method=fedma) or set it in their files (conf/experiment/fedma_method/fedma.yaml)"
    ) in row
    own = unowned_override(["+experiment=pans-table1-cpu", "strategy.fedprox_mu=0.1"])
    assert own.endswith(
        "not to strategy ['fedavg'], which the preset +experiment=pans-table1-cpu picks; leave the override out, "
        "or add strategy=fedprox to run the preset with fedprox instead"
    )
    typed = unowned_override(["+experiment=pans-table1-cpu", "strategy=fedavg", "strategy.fedprox_mu=0.1"])
    assert typed.endswith("set strategy=fedprox or leave the override out"), "the command line chose it"


def test_a_derived_value_that_cannot_be_resolved_names_the_key_that_was_set():
    """A preset's ``${div:...}`` of a bad value names the key the user set and what div takes; a reference to no
    key names the derived key and OmegaConf's reason."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    def problem(study: dict) -> str:
        cfg = OmegaConf.create(
            {"study": study, "train": {"local_epochs": 5, "rounds": "${div:${study.budget},${train.local_epochs}}"}}
        )
        with pytest.raises(OmegaConfBaseException) as error:
            OmegaConf.to_container(cfg, resolve=True)
        return interpolation_problem(cfg, error.value)

    written = "${div:${study.budget},${train.local_epochs}}"
    assert problem({"budget": "abc"}) == (
        f"'study.budget' = 'abc' is not allowed: train.rounds is {written}, and div takes whole numbers, got 'abc'"
    )
    assert problem({"budget": 1.5}).startswith("'study.budget' = 1.5 is not allowed")
    assert problem({}).startswith(f"'train.rounds' = {written} cannot be resolved: Interpolation key 'study.budget'")


def test_a_derived_value_the_schema_refuses_names_the_keys_it_was_derived_from(tmp_path):
    """``study.budget=0`` makes the drift study's rounds 0: the schema's refusal of num-server-rounds says how the
    config derived it, and from which keys."""
    cfg = composed([*TINY, "+study.budget=0", "train.num_server_rounds='${div:${study.budget},${train.local_epochs}}'"])
    with pytest.raises(ConfigError) as error:
        job_settings(cfg, cfg.hydra.runtime.choices, tmp_path)
    assert str(error.value).endswith(
        "run-config key 'num-server-rounds' = 0 is not allowed: must be a positive integer; train.num_server_rounds "
        "is ${div:${study.budget},${train.local_epochs}} here (study.budget = 0, train.local_epochs = 1)"
    )


@pytest.mark.parametrize(
    ("swept", "job", "problem"),
    [
        (
            "strategy=fedavg,nosuch",
            "strategy=nosuch",
            "'strategy' = 'nosuch' is not allowed: choose one of [",
        ),
        (
            "train.num_server_rounds=2,${nope.x}",
            "train.num_server_rounds=$\\{nope.x\\}",  # as Hydra's sweeper writes it
            "'train.num_server_rounds' = ${nope.x} cannot be resolved: Interpolation key 'nope.x' not found",
        ),
    ],
    ids=["unknown-option", "unresolvable"],
)
def test_a_job_of_a_list_that_cannot_be_composed_or_resolved_is_the_schemas_error_of_its_job(swept, job, problem):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=TINY, return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.overrides.task = [*TINY, swept]
        with pytest.raises(ConfigError) as error:
            validate_sweep(cfg)
    message = str(error.value)
    assert message.startswith("sweep job dataset=digits ") and f" {job}: {problem}" in message
    if job == "strategy=nosuch":  # Hydra's options: every registered algorithm (and any a test of this process added)
        assert all(f"'{name}'" in message for name in list_strategies())


@pytest.mark.parametrize(
    ("arguments", "fragments"),
    [
        (["+experiment=drift-quick", "study.budget=abc"], ["'study.budget' = 'abc' is not allowed", "div takes whole"]),
        (
            ["+experiment=drift", "experiment/drift_run=mlp-fedavg,vgg-nosuch", "experiment/drift_epochs=e1"],
            ["'experiment/drift_run' = 'vgg-nosuch' is not allowed: choose one of ['mlp-fedavg', "],
        ),
    ],
    ids=["resolver", "unknown-row"],
)
def test_a_presets_sweep_with_a_bad_value_exits_in_one_line(tmp_path, capfd, arguments, fragments):
    result = command_in_process(capfd, "-m", *arguments, "data.dirichlet_alpha=0.5", f"hydra.sweep.dir={tmp_path}")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("[alignfl] refused before starting: invalid sweep, no job was started: sweep job ")
    assert all(fragment in lines[0] for fragment in fragments), lines[0]
    assert not list(tmp_path.glob("**/.hydra"))


def test_hydras_other_composition_errors_are_one_line():
    from hydra.errors import ConfigCompositionException, MissingConfigException

    missing = MissingConfigException("In 'x': Could not find 'g/b'\n\nAvailable options in 'g':\n\ta", "g/b", ["a"])
    assert composition_problem(missing) == "'g' = 'b' is not allowed: choose one of ['a']"
    other = ConfigCompositionException("Could not override 'train.nope'.\nTo append use +train.nope=1\n\nmore")
    assert composition_problem(other) == "Could not override 'train.nope'. To append use +train.nope=1"


def test_an_unowned_override_exits_with_the_owner_and_no_traceback(tmp_path, capfd):
    result = command_in_process(capfd, "-m", "strategy.fedprox_mu=0.1", f"hydra.sweep.dir={tmp_path}")
    assert result.returncode == 2
    assert "set strategy=fedprox" in result.stderr and "Traceback" not in result.stderr


def test_invalid_sweep_exits_before_any_job_starts(tmp_path):
    """The one refusal run as the command line itself, ``python -m alignfl.fl_app.sweep`` in a process of its own:
    the module's entry point and the interpreter's exit status, end to end. The other refusals run the same
    command in the test's process (command_in_process), without a second interpreter's imports."""
    result = sweep(tmp_path, *TINY, "pan.a=0,-1")
    assert result.returncode == 2
    with pytest.raises(ConfigError) as schema:
        parse_run_config({"pan-a": -1})
    assert str(schema.value) in result.stderr
    assert "no job was started" in result.stderr
    assert not list(tmp_path.glob("**/.hydra")) and not list(tmp_path.glob("**/run"))


def test_a_single_run_with_a_bad_value_is_refused_like_a_sweep_before_its_folder_is_made(tmp_path, capfd):
    result = command_in_process(capfd, *TINY, "pan.a=-1", f"hydra.run.dir={tmp_path / 'job'}")
    assert result.returncode == 2
    with pytest.raises(ConfigError) as schema:
        parse_run_config({"pan-a": -1})
    assert f"refused before starting: {schema.value}" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "job").exists()


def test_a_single_run_with_a_good_config_passes_the_check(tmp_path):
    cfg = composed([*TINY, f"hydra.run.dir={tmp_path / 'job'}"])
    ValidateSweep().on_run_start(cfg)  # returns: SystemExit would end the test
    with open_dict(cfg):
        cfg.pan.a = -1.0
    with pytest.raises(SystemExit) as refused:
        ValidateSweep().on_run_start(cfg)
    assert refused.value.code == 2


def test_a_job_that_cannot_run_is_recorded_as_failed_not_raised(tmp_path):
    (tmp_path / "run").write_text("a file where the run's folder must go")
    cfg = composed(TINY)
    record = run_job(cfg, cfg.hydra.runtime.choices, tmp_path)
    assert record["status"] == "failed" and "FileExistsError" in record["error"]
    assert json.loads((tmp_path / JOB_RECORD).read_text()) == record


def test_a_sweep_run_again_keeps_finished_jobs_and_resumes_interrupted_ones(tmp_path):
    cfg = composed([*TINY, "train.num_server_rounds=2"])
    first = run_job(cfg, cfg.hydra.runtime.choices, tmp_path)
    assert first["status"] == "completed"
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert run_job(cfg, cfg.hydra.runtime.choices, tmp_path) == first  # kept, not run again
    assert json.loads((tmp_path / JOB_RECORD).read_text()) == first
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics
    # stopped after its last checkpoint, before its summary: it goes on from the checkpoint, no round twice
    (tmp_path / "run" / "summary.json").unlink()
    (tmp_path / JOB_RECORD).unlink()
    again = run_job(cfg, cfg.hydra.runtime.choices, tmp_path)
    assert again["status"] == "completed" and (tmp_path / "run" / "summary.json").is_file()
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics
    # a folder without a checkpoint (stopped in its first round) starts afresh
    for name in ("summary.json", "checkpoint.pt", "metrics.jsonl"):
        (tmp_path / "run" / name).unlink()
    (tmp_path / JOB_RECORD).unlink()
    assert run_job(cfg, cfg.hydra.runtime.choices, tmp_path)["status"] == "completed"
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3


def test_sim_settings_are_checked():
    cfg = composed(["sim.backend=threads"])
    with pytest.raises(ConfigError, match="'sim.backend' = 'threads'"):
        job_settings(cfg, cfg.hydra.runtime.choices, Path("/tmp"))
