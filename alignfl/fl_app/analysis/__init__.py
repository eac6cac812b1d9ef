"""PAN diagnostics: shuffle test, weight divergence, matching ratio, class preference vectors.

Each tool is a library function and a command, ``python -m alignfl.fl_app.analysis <tool> --help``;
the commands write ``<tool>.json`` and ``<tool>.png`` into an output folder.
"""

from alignfl.core.metrics.divergence import divergence_by_layer, weight_divergence
from alignfl.fl_app.analysis.common import AnalysisError
from alignfl.fl_app.analysis.matching import GroupMatch, matching_ratio
from alignfl.fl_app.analysis.preference import PreferenceAgreement, compare_preferences, preference_vectors
from alignfl.fl_app.analysis.shuffle import (
    ShuffleOutcome,
    SweepPoint,
    kept_ratio,
    permuted_copy,
    shuffle_error,
    shuffle_permutation,
    shuffle_permutations,
    shuffle_sweep,
    shuffle_test,
)
from alignfl.fl_app.analysis.units import capture_units, unit_sites

__all__ = [
    "AnalysisError",
    "GroupMatch",
    "PreferenceAgreement",
    "ShuffleOutcome",
    "SweepPoint",
    "capture_units",
    "compare_preferences",
    "divergence_by_layer",
    "kept_ratio",
    "matching_ratio",
    "permuted_copy",
    "preference_vectors",
    "shuffle_error",
    "shuffle_permutation",
    "shuffle_permutations",
    "shuffle_sweep",
    "shuffle_test",
    "unit_sites",
    "weight_divergence",
]
