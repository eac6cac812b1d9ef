"""Experiment presets (conf/experiment/*.yaml): each composes, every job of its table validates, a -cpu preset keeps
its paper preset's regime, a preset whose data are not on disk refuses before any job starts, and (slow) every -cpu
preset runs one round."""

import csv
import re
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from alignfl.core.data import DatasetMissingError, ImageDataset
from alignfl.fl_app import server_app
from alignfl.fl_app.sweeps import sweep
from alignfl.fl_app.sweeps.sweep import register_configs, sweep_job_overrides, validate_sweep
from tests.sweep_jobs import command_in_process

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
EXPERIMENTS = CONF / "experiment"
PRESETS = sorted(path.stem for path in EXPERIMENTS.glob("*.yaml"))
CPU_PRESETS = [name for name in PRESETS if name.endswith("-cpu")]
STUDIES = [name for name in PRESETS if name.startswith("drift")]
"""Studies across the papers' regimes, sized for a CPU machine (no paper table, no -cpu twin)."""
ONE_SEED = {"drift-quick", "drift-vgg"}
"""Studies run with one seed: the quick variant, and the drift study's VGG-9 half (the MLP's takes 3)."""
PAPER_PRESETS = [name for name in PRESETS if not name.endswith("-cpu") and name not in STUDIES]
# Data sets a preset reads that this machine may lack (Fashion-MNIST comes from Debian's package).
NOT_SHIPPED = {"mnist", "cifar10"}


@contextmanager
def composed(overrides):
    """The composed config, with Hydra initialised (validate_sweep composes every job through it)."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield compose("config", overrides=list(overrides), return_hydra_config=True)


def _no_network(monkeypatch):
    """torchvision downloads through urllib: a proxy that refuses makes a missing data set fail at once."""
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    # urlopen builds its opener, proxies included, once per process: keep that one from outliving the test
    monkeypatch.setattr(urllib.request, "_opener", None)


def test_presets_come_in_pairs_with_a_cpu_variant():
    assert PAPER_PRESETS, "no presets in conf/experiment"
    assert sorted(f"{name}-cpu" for name in PAPER_PRESETS) == CPU_PRESETS


def _one_seed(jobs):
    """The jobs of seed 0: the other seeds' jobs differ from them only in the seed (checked by the caller)."""
    return [job for job in jobs if "seed=0" in job]


def _checked(name: str, jobs: list[list[str]]) -> list[list[str]]:
    """The jobs whose configurations a test composes and validates: seed 0's; of a study (80 configurations,
    a third of a second each to compose), one job of each choice of config groups (every method row with every
    E), taking the plain values it sweeps (the Dirichlet alpha) in turn, so that each is checked too."""
    seed_zero = _one_seed(jobs)
    if name not in STUDIES:
        return seed_zero
    by_groups: dict[tuple[str, ...], list[list[str]]] = {}
    for job in seed_zero:
        by_groups.setdefault(tuple(o for o in job if "/" in o.split("=")[0]), []).append(job)
    return [variants[turn % len(variants)] for turn, variants in enumerate(by_groups.values())]


#: What a -cpu preset keeps from its full twin: the papers' effects live in long local training, partial
#: participation and the heterogeneity of the split, so a -cpu preset shrinks width, data, clients and rounds instead.
REGIME = (
    "train.local_epochs",
    "train.fraction_train",
    "data.partitioner",
    "data.dirichlet_alpha",
    "data.classes_per_client",
    "strategy.fedma_retrain_epochs",
)


def _settings(overrides: list[str]) -> dict[str, str]:
    return dict(override.split("=", 1) for override in overrides)


def _as_full(key: str, value: str) -> str:
    """A -cpu preset's choice of a preset or of one of its rows (``fedma16-cpu``) as its full twin names it."""
    return value.removesuffix("-cpu") if "experiment" in key else value


@dataclass
class Validated:
    """One preset's sweep as ValidateSweep checks it, with an empty data root: every job of seed 0 composed and
    validated once, shared by the tests below (composing a preset's jobs is most of their time)."""

    mode: str
    jobs: list[list[str]]
    """Every job's overrides, all seeds."""
    validated: list[tuple[dict[str, str], dict]]
    """Each seed-0 job that passed job_settings (the schema, the model built, the algorithm's server side): its
    overrides, and its regime values and config-group choices."""
    needs: set[str]
    error: DatasetMissingError | None
    first: tuple
    """The preset's own defaults as one job: its run config and simulation settings."""
    sweep_dir: Path


def _validate(name: str, folder: Path) -> Validated:
    needs, validated = set(), []
    real_check, real_settings = sweep.check_dataset_available, sweep.job_settings

    def check(dataset, root):
        needs.add(dataset)
        real_check(dataset, root)

    def settings(job, choices, results):
        config = real_settings(job, choices, results)
        values = {key: OmegaConf.select(job, key, default=None) for key in REGIME}
        validated.append({**values, "choices": dict(choices)})
        return config

    sweep_dir, data_root = folder / "sweep", folder / "data"
    data_root.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        _no_network(patch)
        patch.setattr(sweep, "check_dataset_available", check)
        patch.setattr(sweep, "job_settings", settings)
        with composed([f"+experiment={name}", f"hydra.sweep.dir={sweep_dir}", f"data.root={data_root}"]) as cfg:
            jobs = sweep_job_overrides(cfg)
            patch.setattr(sweep, "sweep_job_overrides", lambda config: _checked(name, jobs))
            try:
                validate_sweep(cfg)
                error = None
            except DatasetMissingError as raised:
                error = raised
            first = real_settings(cfg, cfg.hydra.runtime.choices, folder)
            mode = str(cfg.hydra.mode)
    overrides = [_settings([o for o in job if not o.startswith("data.root=")]) for job in _checked(name, jobs)]
    return Validated(mode, jobs, list(zip(overrides, validated)), needs, error, first, sweep_dir)


@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    """``validated(name)``: the preset's :class:`Validated`, computed once per test module."""
    cache: dict[str, Validated] = {}

    def get(name: str) -> Validated:
        if name not in cache:
            cache[name] = _validate(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


def _lines_setting(path: Path, dotted: str) -> list[tuple[str, str]]:
    """(value, comment) of each line of a preset file that sets ``section.key``; a comment goes on over the
    comment-only lines below it that are indented past the key."""
    section, key = dotted.split(".")
    found, current, inside = [], None, False
    for line in path.read_text().splitlines():
        code, _, comment = line.partition("#")
        indent = len(line) - len(line.lstrip())
        if not code.strip():
            if inside and comment and indent > 2:
                found[-1] = (found[-1][0], f"{found[-1][1]} {comment.strip()}")
                continue
            inside = False
            continue
        inside = False
        name, _, value = code.strip().partition(":")
        if indent == 0:
            current = name
        elif indent == 2 and current == section and name == key:
            found.append((value.strip(), comment.strip()))
            inside = True
    return found


def _says_what_was_cut(files: list[Path], dotted: str, value, full_value) -> bool:
    """Whether a line setting ``dotted`` to ``value`` says it was cut: "cut" and the full preset's value."""
    full = re.compile(rf"(?<![\w.]){re.escape(str(full_value))}(?![\w]|\.\d)")
    return any(
        yaml.safe_load(text) == value and re.search(r"\bcut\b", comment) and full.search(comment)
        for path in files
        for text, comment in _lines_setting(path, dotted)
    )


def test_a_cut_is_allowed_only_where_its_line_says_so(tmp_path):
    """The exception the previous test allows: "cut" and the full value in the comment of the line that sets it."""
    preset = tmp_path / "x-cpu.yaml"
    preset.write_text(
        "train:\n"
        "  num_server_rounds: 5     # x: 150\n"
        "  local_epochs: 2          # x: 20\n"
        "  fraction_train: 0.4      # cut from 1.0: every client every round\n"
        "                           # would take 2 hours here\n"
        "data:\n"
        "  dirichlet_alpha: 0.5\n"
    )
    assert _lines_setting(preset, "train.fraction_train") == [
        ("0.4", "cut from 1.0: every client every round would take 2 hours here")
    ]
    assert _says_what_was_cut([preset], "train.fraction_train", 0.4, 1.0)
    assert not _says_what_was_cut([preset], "train.fraction_train", 0.4, 0.5), "the full value, not another"
    assert not _says_what_was_cut([preset], "train.local_epochs", 2, 20), "a full value without 'cut' is not enough"
    assert not _says_what_was_cut([preset], "data.dirichlet_alpha", 0.5, 0.1)


@pytest.mark.parametrize("name", CPU_PRESETS)
def test_a_cpu_preset_keeps_its_full_twins_regime(name, validated):
    """Every job of a -cpu preset has the local epochs, participation, split (partitioner, Dirichlet alpha,
    classes per client) and FedMA retraining epochs of the matching job of its full twin (the same sweep values,
    ``-cpu`` rows as the rows they scale), unless the -cpu line that sets the value says what was cut: the word
    "cut" and the full preset's value in its comment."""
    full_jobs = validated(name.removesuffix("-cpu")).validated
    problems = {}  # a dict: the same message once where a -cpu job has two twins
    for overrides, cpu in validated(name).validated:
        as_full = {key: _as_full(key, value) for key, value in overrides.items()}
        twins = [job for settings, job in full_jobs if all(as_full.get(k, v) == v for k, v in settings.items())]
        assert twins, f"{name} job {overrides}: no job of {name.removesuffix('-cpu')} has these sweep values"
        rows = [f"{group}/{choice}" for group, choice in cpu["choices"].items() if group.startswith("experiment/")]
        files = [EXPERIMENTS / f"{name}.yaml", *(CONF / f"{row}.yaml" for row in rows)]
        for full in twins:
            for key in REGIME:
                if cpu[key] != full[key] and not _says_what_was_cut(files, key, cpu[key], full[key]):
                    job = " ".join(f"{k}={v}" for k, v in overrides.items() if k not in ("seed", "+experiment"))
                    problems[f"{job or '(its one job)'}: {key} is {cpu[key]}, {full[key]} in the full preset"] = None
    assert not problems, (
        f"{name} changes the regime of its full twin without saying what was cut (keep the full value, shrink "
        "width, data, clients or rounds instead; or write 'cut' and the full value on that line):\n"
        + "\n".join(problems)
    )


@pytest.mark.parametrize("name", PRESETS)
def test_every_job_of_a_preset_composes_and_validates(name, validated):
    """The preset runs as a multirun of its whole table, 3 seeds, and ValidateSweep's check (the schema, the model
    built, the algorithm's server side) passes for every configuration. The data check is the next test's."""
    preset = validated(name)
    assert preset.mode == "RunMode.MULTIRUN", "a preset runs its whole table without -m"
    seeds = [next(o for o in job if o.startswith("seed=")) for job in preset.jobs]
    expected = ["seed=0"] if name in ONE_SEED else ["seed=0", "seed=1", "seed=2"]
    assert sorted(set(seeds)) == expected and len(preset.jobs) == len(expected) * seeds.count("seed=0")
    others = {tuple(o for o in job if not o.startswith("seed=")) for job in preset.jobs}
    assert len(others) == seeds.count("seed=0"), "the other seeds' jobs differ from seed 0's in the seed alone"
    assert len(preset.validated) == len(_checked(name, preset.jobs)), "every configuration checked passed the schema"
    if name in STUDIES:  # every method row and every E, and every plain value swept, in the configurations checked
        for key in ("experiment/drift_run", "experiment/drift_epochs", "data.dirichlet_alpha"):
            swept = {o for job in preset.jobs for o in job if o.startswith(f"{key}=")}
            assert swept and swept == {f"{key}={settings[key]}" for settings, _ in preset.validated}
    assert preset.needs, "the sweep checks its data sets"
    first, sim = preset.first  # the preset's own defaults: one job too
    assert first.device == "auto"
    assert (sim.backend, sim.vectorise) == ("batched", "auto"), "every preset runs on the batched engine"
    if name.endswith("-cpu"):
        assert first.dataset == "fashion-mnist", "a -cpu preset runs on the data this machine has"


PAPERS = (
    "Li et al., CVPR 2022",
    "Yu et al., KDD 2021",
    "Hahn et al., KDD 2022",
    "L46 FedMA Project",
    "Wang et al., ICLR 2020",
)
"""How the presets cite the papers whose tables they follow (PANs, Fed2, SuPerFed, the FedMA study, FedMA)."""


def test_a_preset_file_says_which_paper_table_it_follows():
    for name in PRESETS:
        text = (EXPERIMENTS / f"{name}.yaml").read_text()
        assert text.startswith("# @package _global_\n"), name
        assert "python -m alignfl.fl_app.sweep +experiment=" + name in text, f"{name}: its command is in its header"
        cited = any(paper in text for paper in PAPERS)
        assert cited or name.endswith("-cpu"), f"{name}: cites its paper by authors and venue ({PAPERS})"
        yaml.safe_load(text)


@pytest.mark.parametrize("name", [*PAPER_PRESETS, *STUDIES])
def test_a_preset_whose_data_are_missing_refuses_before_any_job(name, validated):
    """With an empty data root, ValidateSweep's check raises the data set's own message (how to get it, in
    torchvision's layout) for a preset that reads MNIST or CIFAR-10, and passes for one on Fashion-MNIST."""
    preset = validated(name)
    if preset.needs & NOT_SHIPPED:
        assert preset.error is not None and "torchvision's layout" in str(preset.error), preset.error
        assert f"dataset '{min(preset.needs & NOT_SHIPPED, key=str)}' not found" in str(preset.error)
    else:
        assert preset.error is None and preset.needs == {"fashion-mnist"}
    assert not list(preset.sweep_dir.glob("**/.hydra")), "no job started"


def test_the_cifar10_preset_exits_with_the_data_message_before_any_job(tmp_path, monkeypatch, capfd):
    """The command itself, run in the test's process: `python -m alignfl.fl_app.sweep +experiment=pans-table1` (a
    multirun by the preset's own hydra.mode, no -m) with an empty data root."""
    empty = tmp_path / "data"
    empty.mkdir()
    _no_network(monkeypatch)
    result = command_in_process(
        capfd, "+experiment=pans-table1", f"data.root={empty}", f"hydra.sweep.dir={tmp_path / 'sweep'}"
    )
    assert result.returncode != 0
    assert "invalid sweep, no job was started: dataset 'cifar10' not found" in result.stderr
    assert "torchvision's layout" in result.stderr
    assert not list((tmp_path / "sweep").glob("**/.hydra")), "no job started"


SERVER_TEST_IMAGES = 1000
"""Test images the server scores the global model on in a one-round run: scoring all 10,000 of Fashion-MNIST's,
at round 0 and after the round, took over a third of these runs' time."""


def _cut_server_test_split(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """The server's data set with its test split cut to the first ``size`` images; the clients' data, and the
    tensors the data cache holds, as they are."""
    load = server_app.load_dataset

    def cut(name: str, data_root: str | None = None) -> ImageDataset:
        dataset = load(name, data_root)
        return replace(dataset, test_x=dataset.test_x[:size], test_y=dataset.test_y[:size])

    monkeypatch.setattr(server_app, "load_dataset", cut)


@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_PRESETS)
def test_a_cpu_preset_runs_one_round_of_its_last_configuration(name, tmp_path, validated, capfd, monkeypatch):
    """The table's last configuration (the paper's method, in the largest setting), seed 0, one round of one local
    epoch (FedMA: one retraining epoch too), on the preset's own engine (batched), torch at 1 thread, run by the sweep
    command (its check, the job, its report) in the test's process: a process of its own would spend seconds
    importing what this one has. The server scores the global model on the first :data:`SERVER_TEST_IMAGES` test
    images. That every other configuration composes and validates, and that each keeps its paper's local epochs,
    are the fast tests' above."""
    _cut_server_test_split(monkeypatch, SERVER_TEST_IMAGES)
    preset = validated(name)  # its jobs, composed once for the fast tests
    last = [override for override in _one_seed(preset.jobs)[-1] if not override.startswith("data.root=")]
    settings, composed_values = preset.validated[-1]
    assert settings == _settings(last), "the validated jobs end with the same job"
    retrains = composed_values["strategy.fedma_retrain_epochs"] is not None
    result = command_in_process(
        capfd,
        *last,
        "hydra.sweeper.params=null",
        "train.num_server_rounds=1",
        "train.local_epochs=1",
        *(["strategy.fedma_retrain_epochs=1"] if retrains else []),
        "sim.torch_threads=1",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    with (tmp_path / "summary.csv").open() as stream:
        rows = list(csv.DictReader(stream))
    assert len(rows) == 1 and rows[0]["seeds"] == "1" and rows[0]["failed"] == "0", rows
    assert all(value.split("=")[1] in rows[0].values() for value in last if not value.startswith(("seed=", "+"))), (
        last,
        rows,
    )
