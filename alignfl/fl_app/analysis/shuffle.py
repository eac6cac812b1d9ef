"""Shuffle test: how much a network's output changes when its hidden units are permuted.

PANs paper (Li et al., "Federated Learning with Position-Aware Neurons", CVPR 2022): without PANs a
network is permutation invariant, so shuffling its hidden units (and the next layer's inputs with them)
changes nothing; PANs bind units to positions, so the shuffled network's output moves, more so for larger ``A`` and
faster for multiplicative than additive PANs (Sect. 3.2, Fig. 3).

* Permutations: the paper's Algorithm 1 (its Supp. D.1) builds a random
  permutation whose disorder is set by ``P_sf``. The transcript of the paper has the
  text around Alg. 1 but not its pseudo-code, so the steps below follow that text
  ("randomly generated", "at most J swaps", O(J)), the method notes and the authors'
  public code (``generate_sf_inds``): start from the identity; for each unit ``i`` in
  order draw ``j`` uniformly from ``i .. min(J-1, i + w)`` (``w = int(window * J)``,
  the window; the unit itself included) and, with probability ``P_sf``, swap the
  entries at ``i`` and ``j``. With ``window = 1`` and ``P_sf = 1`` this is a
  Fisher-Yates shuffle (a uniformly random permutation); ``P_sf = 0`` or
  ``window = 0`` give the identity. The uniform draws are made up front from a seeded
  generator, so for one seed the swaps at a smaller ``P_sf`` are a subset of those
  at a larger one (curves over ``P_sf`` use common random numbers).
* ``R_kept = mean(diag(Pi))``: the fraction of hidden units left in place (pooled over
  every group of the model).
* Shuffle error, Eq. 8: ``Err = ||h_L,sf - h_L|| / J_L`` on the output logits
  (``J_L`` = number of classes), averaged over a batch of Gaussian inputs
  ``x ~ N(0, 1)`` (as in the paper's "shuffle error with random data").

Permutations act on every group of the model's ``permutation_spec()`` through
``permute_state``; PAN encodings are non-persistent buffers and do not move.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from alignfl.core.data import dataset_info
from alignfl.core.training.sgd import evaluate
from alignfl.fl_app.analysis.common import (
    AnalysisError,
    Subcommand,
    add_common_arguments,
    check_choice,
    check_fresh_model,
    check_model_path,
    check_non_negative,
    check_positive_int,
    check_unit_interval,
    load_run_model,
    pyplot,
    save_outputs,
)
from alignfl.fl_app.analysis.units import spec_of
from alignfl.models import PanSettings, PermutationSpec, build_model, permute_state
from alignfl.models.init import (
    INITS,  # how a sweep's shared weights start: their scale decides how add and mul PANs compare
)

DEFAULT_P_SF = (0.0, 0.1, 0.25, 0.5, 1.0)
DEFAULT_AMPLITUDES = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0)
SWEEP_MODES = ("add", "mul")


# --- Algorithm 1 --------------------------------------------------------------------


def shuffle_permutation(num_units: int, p_sf: float, generator: torch.Generator, window: float = 1.0) -> Tensor:
    """A random permutation of ``num_units`` units with disorder ``p_sf`` (Alg. 1; see the module notes).

    Returns ``perm`` with the library's convention: new unit ``i`` is old unit ``perm[i]``.
    """
    check_positive_int("num_units", num_units)
    p_sf = check_unit_interval("P_sf", p_sf)
    span = int(check_unit_interval("window", window) * num_units)
    swap_draws = torch.rand(num_units, generator=generator, dtype=torch.float64).tolist()
    partner_draws = torch.rand(num_units, generator=generator, dtype=torch.float64).tolist()
    order = list(range(num_units))
    for i in range(num_units):
        choices = min(num_units - 1, i + span) - i + 1
        j = i + min(int(partner_draws[i] * choices), choices - 1)
        if swap_draws[i] < p_sf:
            order[i], order[j] = order[j], order[i]
    return torch.tensor(order, dtype=torch.long)


def shuffle_permutations(
    spec: PermutationSpec, state: Mapping[str, Tensor], p_sf: float, generator: torch.Generator, window: float = 1.0
) -> dict[str, Tensor]:
    """One Algorithm-1 permutation per group of ``spec``, drawn in spec order."""
    return {name: shuffle_permutation(size, p_sf, generator, window) for name, size in spec.group_sizes(state).items()}


def kept_ratio(perms: Mapping[str, Tensor]) -> float:
    """``R_kept``: fraction of all hidden units (pooled over groups) that stay at their index."""
    kept = sum(int((perm == torch.arange(len(perm))).sum()) for perm in perms.values())
    return kept / sum(len(perm) for perm in perms.values())


def permuted_copy(model: nn.Module, perms: Mapping[str, Tensor]) -> nn.Module:
    """A deep copy of ``model`` with its hidden units permuted through its spec."""
    shuffled = copy.deepcopy(model)
    shuffled.load_state_dict(permute_state(spec_of(model), model.state_dict(), perms))
    return shuffled.eval()


@torch.no_grad()
def shuffle_error(reference: Tensor, shuffled: Tensor) -> float:
    """Eq. 8 on a batch of outputs ``(N, J_L)``: mean over samples of ``||h_sf - h||_2 / J_L``."""
    return float(((shuffled - reference).double().norm(dim=1) / reference.shape[1]).mean())


# --- the test -----------------------------------------------------------------------


@dataclass(frozen=True)
class ShuffleOutcome:
    """One ``P_sf`` on one model: mean (and std over repeats) of the error, and ``R_kept``.

    ``accuracy`` / ``accuracy_change`` (shuffled minus original test accuracy, mean over
    repeats) are set only when test data was given.
    """

    p_sf: float
    error: float
    error_std: float
    r_kept: float
    accuracy: float | None = None
    accuracy_change: float | None = None


def gaussian_inputs(input_shape: Sequence[int], batch: int, seed: int) -> Tensor:
    """The random data of the paper's shuffle test: ``x ~ N(0, 1)``, seeded."""
    check_positive_int("batch", batch)
    return torch.randn((batch, *input_shape), generator=torch.Generator().manual_seed(seed))


def draw_permutations(
    model: nn.Module, p_sf: float, repeats: int, seed: int, window: float = 1.0
) -> list[dict[str, Tensor]]:
    """``repeats`` independent Algorithm-1 draws for every group; repeat ``r`` uses seed ``seed + r``."""
    check_positive_int("repeats", repeats)
    spec, state = spec_of(model), model.state_dict()
    return [
        shuffle_permutations(spec, state, p_sf, torch.Generator().manual_seed(seed + r), window) for r in range(repeats)
    ]


@torch.no_grad()
def shuffle_test(
    model: nn.Module,
    p_sf: float,
    inputs: Tensor,
    *,
    repeats: int = 3,
    seed: int = 0,
    window: float = 1.0,
    test_data: tuple[Tensor, Tensor] | None = None,
) -> ShuffleOutcome:
    """Shuffle ``model``'s hidden units ``repeats`` times at ``p_sf`` and measure Eq. 8 on ``inputs``.

    With ``test_data = (x, y)`` also the change of test accuracy (the paper's Fig. 4).
    """
    model.eval()
    reference = model(inputs)
    base_accuracy = _accuracy(model, test_data)
    errors, kept, accuracies = [], [], []
    for perms in draw_permutations(model, p_sf, repeats, seed, window):
        shuffled = permuted_copy(model, perms)
        errors.append(shuffle_error(reference, shuffled(inputs)))
        kept.append(kept_ratio(perms))
        accuracies.append(_accuracy(shuffled, test_data))
    accuracy = statistics.fmean(accuracies) if test_data is not None else None
    return ShuffleOutcome(
        p_sf=float(p_sf),
        error=statistics.fmean(errors),
        error_std=statistics.pstdev(errors),
        r_kept=statistics.fmean(kept),
        accuracy=accuracy,
        accuracy_change=None if accuracy is None else accuracy - base_accuracy,
    )


def _accuracy(model: nn.Module, test_data: tuple[Tensor, Tensor] | None) -> float:
    return math.nan if test_data is None else evaluate(model, *test_data, torch.device("cpu"))[1]


# --- the PAN sweep ------------------------------------------------------------------


@dataclass(frozen=True)
class SweepPoint:
    """The shuffle test of one PAN setting at one ``P_sf``."""

    mode: str
    amplitude: float
    p_sf: float
    error: float
    error_std: float
    r_kept: float


@torch.no_grad()
def shuffle_sweep(
    model_name: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    *,
    modes: Sequence[str] = SWEEP_MODES,
    amplitudes: Sequence[float] = DEFAULT_AMPLITUDES,
    p_sfs: Sequence[float] = DEFAULT_P_SF,
    period: float = 1.0,
    repeats: int = 3,
    batch: int = 64,
    seed: int = 0,
    window: float = 1.0,
    init: str = "default",
) -> list[SweepPoint]:
    """The shuffle test of one fresh network under every (mode, A), at every ``P_sf``.

    All settings share the same weights (built once with ``seed``, then ``init``), the
    same Gaussian inputs and the same permutations: PAN encodings are non-persistent
    buffers made from the settings, so only they differ between the models compared.

    How ``add`` compares with ``mul`` at the same ``A`` depends on the size of the
    pre-activations ``h``: the additive shift is ``A * sin(.)`` whatever ``h`` is, the
    multiplicative one ``A * sin(.) * h``. With PyTorch's default init, activations
    shrink with depth (``|h|`` well below 1) and the additive error is the larger one
    at equal ``A``, while the multiplicative error grows faster than linearly in ``A``
    (the paper's "increases quickly"); with ``init="he"`` (``|h|`` of order 1) the
    multiplicative error is larger at every ``A`` as well.
    """
    _check_sweep(model_name, modes, amplitudes, p_sfs, period, window, init)
    torch.manual_seed(seed)
    base = build_model(model_name, input_shape, num_classes)
    INITS[init](base)
    state = base.state_dict()
    inputs = gaussian_inputs(input_shape, batch, seed)
    draws = {p: draw_permutations(base, p, repeats, seed, window) for p in p_sfs}
    points = []
    for mode in modes:
        for amplitude in amplitudes:
            model = _with_state(model_name, input_shape, num_classes, PanSettings(mode, period, amplitude), state)
            reference = model(inputs)
            for p_sf, perm_list in draws.items():
                errors = [shuffle_error(reference, permuted_copy(model, perms)(inputs)) for perms in perm_list]
                points.append(
                    SweepPoint(
                        mode,
                        float(amplitude),
                        float(p_sf),
                        statistics.fmean(errors),
                        statistics.pstdev(errors),
                        statistics.fmean(kept_ratio(perms) for perms in perm_list),
                    )
                )
    return points


def _with_state(
    name: str, shape: tuple[int, int, int], classes: int, pan: PanSettings, state: Mapping[str, Tensor]
) -> nn.Module:
    model = build_model(name, shape, classes, pan)
    model.load_state_dict(state)
    return model.eval()


def _check_sweep(
    model_name: str,
    modes: Sequence[str],
    amplitudes: Sequence[float],
    p_sfs: Sequence[float],
    period: float,
    window: float,
    init: str,
) -> None:
    for mode in modes:
        check_choice("PAN mode", mode, SWEEP_MODES)
    for amplitude in amplitudes:
        check_non_negative("PAN amplitude A", amplitude)
    for p_sf in p_sfs:
        check_unit_interval("P_sf", p_sf)
    check_non_negative("PAN period T", period)
    check_unit_interval("window", window)
    check_choice("init", init, list(INITS))
    if not (modes and amplitudes and p_sfs):
        raise AnalysisError("a sweep needs at least one mode, one amplitude and one P_sf")


# --- command line -------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--run",
        help="run folder (model.pt + config.json) or model.pt: shuffle the trained model, "
        "report error on Gaussian input and test-accuracy change per P_sf",
    )
    source.add_argument("--model", help="fresh network to sweep over PAN modes and amplitudes")
    parser.add_argument(
        "--dataset", default="digits", help="with --model: dataset giving input shape and class count (default: digits)"
    )
    parser.add_argument(
        "--p-sf",
        type=float,
        nargs="+",
        default=list(DEFAULT_P_SF),
        help=f"disorder levels P_sf in [0, 1] (default: {' '.join(map(str, DEFAULT_P_SF))})",
    )
    parser.add_argument(
        "--window",
        type=float,
        default=1.0,
        help="Alg. 1 window as a fraction of the layer width, in [0, 1] (default: 1, whole layer)",
    )
    parser.add_argument("--modes", nargs="+", default=list(SWEEP_MODES), help="with --model: PAN modes (add, mul)")
    parser.add_argument(
        "--amplitudes",
        type=float,
        nargs="+",
        default=list(DEFAULT_AMPLITUDES),
        help=f"with --model: PAN amplitudes A (default: {' '.join(map(str, DEFAULT_AMPLITUDES))})",
    )
    parser.add_argument("--period", type=float, default=1.0, help="with --model: PAN period T (default: 1)")
    parser.add_argument(
        "--init",
        default="default",
        help=f"with --model: weight init, one of {list(INITS)} (default: PyTorch's; 'he' keeps activations of order 1)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="permutation draws per P_sf (default: 3)")
    parser.add_argument("--batch", type=int, default=64, help="Gaussian input samples (default: 64)")
    add_common_arguments(parser)


def run(args: argparse.Namespace, out: Path) -> list[Path]:
    for p_sf in args.p_sf:
        check_unit_interval("--p-sf", p_sf)
    check_unit_interval("--window", args.window)
    check_positive_int("--repeats", args.repeats)
    check_positive_int("--batch", args.batch)
    if args.run is not None:
        check_model_path(args.run)
        return _run_trained(args, out)
    check_fresh_model(args.model, args.dataset)
    _check_sweep(args.model, args.modes, args.amplitudes, args.p_sf, args.period, args.window, args.init)
    return _run_sweep(args, out)


def _run_trained(args: argparse.Namespace, out: Path) -> list[Path]:
    loaded = load_run_model(args.run)
    data = loaded.dataset
    inputs = gaussian_inputs(data.input_shape, args.batch, args.seed)
    outcomes = [
        shuffle_test(
            loaded.model,
            p,
            inputs,
            repeats=args.repeats,
            seed=args.seed,
            window=args.window,
            test_data=(data.test_x, data.test_y),
        )
        for p in args.p_sf
    ]
    for o in outcomes:
        print(
            f"P_sf={o.p_sf:<5g} R_kept={o.r_kept:.3f} error={o.error:.3e} "
            f"accuracy={o.accuracy:.4f} change={o.accuracy_change:+.4f}"
        )
    payload = {
        "tool": "shuffle-test",
        "source": loaded.source,
        "dataset": data.name,
        "pan": asdict(loaded.pan),
        "window": args.window,
        "repeats": args.repeats,
        "batch": args.batch,
        "seed": args.seed,
        "error": "Eq. 8: mean over Gaussian inputs of ||h_sf - h|| / J_L on the logits",
        "results": [asdict(o) for o in outcomes],
    }
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    p = [o.p_sf for o in outcomes]
    left.errorbar(p, [o.error for o in outcomes], yerr=[o.error_std for o in outcomes], marker="o")
    left.set(xlabel="P_sf", ylabel="shuffle error (Eq. 8)", title="Gaussian input")
    right.plot(p, [o.accuracy_change for o in outcomes], marker="o")
    right.set(xlabel="P_sf", ylabel="test accuracy change", title=f"{data.name} test split")
    pan = loaded.pan
    fig.suptitle(f"{loaded.source}  (PAN {pan.mode}, T={pan.period:g}, A={pan.amplitude:g})", fontsize=9)
    return _save(out, payload, fig, plt)


def _run_sweep(args: argparse.Namespace, out: Path) -> list[Path]:
    input_shape, num_classes = dataset_info(args.dataset)
    points = shuffle_sweep(
        args.model,
        input_shape,
        num_classes,
        modes=args.modes,
        amplitudes=args.amplitudes,
        p_sfs=args.p_sf,
        period=args.period,
        repeats=args.repeats,
        batch=args.batch,
        seed=args.seed,
        window=args.window,
        init=args.init,
    )
    for pt in points:
        print(f"{pt.mode} A={pt.amplitude:<5g} P_sf={pt.p_sf:<5g} R_kept={pt.r_kept:.3f} error={pt.error:.3e}")
    payload = {
        "tool": "shuffle-test",
        "model": args.model,
        "input_shape": list(input_shape),
        "num_classes": num_classes,
        "period": args.period,
        "init": args.init,
        "window": args.window,
        "repeats": args.repeats,
        "batch": args.batch,
        "seed": args.seed,
        "error": "Eq. 8: mean over Gaussian inputs of ||h_sf - h|| / J_L on the logits",
        "results": [asdict(pt) for pt in points],
    }
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colours = {"add": "tab:blue", "mul": "tab:red"}
    shuffled = sorted({pt.p_sf for pt in points if pt.p_sf > 0})
    for mode in args.modes:
        for rank, p_sf in enumerate(shuffled, start=1):
            line = [pt for pt in points if pt.mode == mode and pt.p_sf == p_sf]
            left.plot(
                [pt.amplitude for pt in line],
                [pt.error for pt in line],
                marker="o",
                color=colours.get(mode),
                alpha=rank / len(shuffled),
                label=f"{mode}, P_sf={p_sf:g}",
            )
    left.set(
        xlabel="PAN amplitude A",
        ylabel="shuffle error (Eq. 8)",
        yscale="log",
        title=f"{args.model}, T={args.period:g}, init={args.init}",
    )
    left.legend(fontsize=7)
    kept = sorted(
        {(pt.p_sf, pt.r_kept) for pt in points if pt.mode == args.modes[0] and pt.amplitude == args.amplitudes[0]}
    )
    right.plot([k[0] for k in kept], [k[1] for k in kept], marker="o")
    right.set(xlabel="P_sf", ylabel="R_kept = mean(diag(Pi))", ylim=(0, 1.05), title="units left in place")
    return _save(out, payload, fig, plt)


def _save(out: Path, payload: dict, fig, plt) -> list[Path]:
    for axis in fig.axes:
        axis.grid(alpha=0.3)
    fig.tight_layout()
    return save_outputs(out, "shuffle-test", payload, fig)


COMMAND = Subcommand(
    name="shuffle-test",
    summary="shuffle error (Eq. 8) and R_kept under Algorithm-1 permutations; PAN sweep or a trained run",
    description=__doc__,
    add_arguments=add_arguments,
    run=run,
)
