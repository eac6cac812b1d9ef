"""OT fusion: every round, carry each client model's units onto the global model's by optimal transport, then
average (Singh & Jaggi, "Model Fusion via Optimal Transport", NeurIPS 2020, arXiv:1910.05653).

Clients run FedAvg's local SGD. The server aligns every reply onto the global model the clients started from
(``otfusion-reference=global``) or onto the model of the round's client of the lowest partition id (``client``: the
clients' units keep the imprint of the round's start, so only a client reference can carry units that drifted apart
between clients onto one another; :mod:`alignfl.core.merging.reference`) with :mod:`alignfl.core.merging.ot_fusion`
(exact OT or Sinkhorn, layer by layer from the input, over the model's permutation description) and averages the aligned
models weighted by examples (``server-weighting``). The authors fuse two
models with ``ensemble_step``; fusing K client models onto the global model, the reference only fixes the units'
order and the example weights take the step's place. PAN encodings never travel, so nothing here knows whether
PANs are on (as for ``matched``: a soft map also mixes units of different positions).

Clients of different widths (``client-widths``, :mod:`alignfl.core.widths`): a client gets the global model made its
width, ``otfusion-downsize`` ``ot`` (the global model fused onto its own first units by the same transport: every
global unit contributes to the narrower model, as the authors compress a model into a smaller width) or ``slice``
(HeteroFL's first units); its reply, at its width, is carried back onto the global model's units by OT, so a
narrow client's unit is spread over several global units (with ``otfusion-split-outgoing`` its outgoing weights
are split among them).

With ``repair=on`` (:mod:`alignfl.core.rounds.repair_round`) a client's unit statistics follow its transport maps: a
fused unit's target is the coupling-weighted mean of the mean and std of the client units carried onto it (exact for a
permutation; for a soft map the std of a mix of units is not known without their covariances, and the weighted
mean of their stds is its upper bound).

Run-config keys ``otfusion-<field>``: the fields of :class:`alignfl.core.merging.ot_fusion.OTSettings` (their defaults
and where they come from are in that module's notes), ``otfusion-downsize`` and ``otfusion-reference`` (``global`` only
with ``client-widths``: a narrower client's model cannot carry the wider ones).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from logging import INFO

from flwr.app import ArrayRecord
from flwr.common.logger import log
from torch import Tensor

from alignfl.core.merging.ot_fusion import OTSettings, align_onto, ot_fuse
from alignfl.core.merging.reference import CLIENT, STARTS
from alignfl.core.rounds.strategy import Merge, Reply, RunContext, ServerStrategy, states_and_weights
from alignfl.core.rounds.sub_models import ClientWidths, first_units
from alignfl.core.widths import mixed_widths
from alignfl.plugins.options import ConfigError, choice, option_from, refuse, source_settings
from alignfl.strategies.base import LocalUpdate
from alignfl.strategies.registry import STRATEGIES, Algorithm

DOWNSIZE = ("ot", "slice")


@dataclass(frozen=True)
class OTFusionSettings:
    otfusion_exact: bool = option_from(OTSettings, "exact")
    otfusion_reg: float = option_from(OTSettings, "reg")
    otfusion_ground_metric: str = option_from(OTSettings, "ground_metric")
    otfusion_squared: bool = option_from(OTSettings, "squared")
    otfusion_normalize_cost: str = option_from(OTSettings, "normalize_cost")
    otfusion_normalize_weights: bool = option_from(OTSettings, "normalize_weights")
    otfusion_marginals: str = option_from(OTSettings, "marginals")
    otfusion_correction: bool = option_from(OTSettings, "correction")
    otfusion_past_correction: bool = option_from(OTSettings, "past_correction")
    otfusion_split_outgoing: bool = option_from(OTSettings, "split_outgoing")
    otfusion_downsize: str = choice(
        "ot",
        "how a narrower client gets the global model: ot (fused onto the global model's first units) or slice "
        "(HeteroFL's first units)",
        DOWNSIZE,
    )
    otfusion_reference: str = choice(
        "global",
        "what client units are carried onto: global (the round's global model) or client (the model of the round's "
        "client of the lowest partition id)",
        STARTS,
    )

    def transport(self) -> OTSettings:
        """OT fusion's settings: the ``otfusion-*`` fields are :class:`~alignfl.core.merging.ot_fusion.OTSettings`'s,
        borrowed."""
        return source_settings(self, OTSettings)


class OTFusion(ServerStrategy):
    """FedAvg whose average is taken after carrying every client model onto the global model by OT (module notes)."""

    aligns_to_reference = True
    repairable = True

    mixed_widths = True

    def __init__(self, context: RunContext) -> None:
        super().__init__(context)
        self.spec = context.required_spec("otfusion")
        self.ot = self.settings.transport()
        self.client_widths = (
            ClientWidths(context.config, context.spec, context.initial_arrays.to_torch_state_dict(), nested=False)
            if mixed_widths(context.config)
            else None
        )
        if self.client_widths is not None and not self.ot.past_correction:
            raise ConfigError(
                "run-config key 'otfusion-past-correction' = False is not allowed with clients of different "
                "widths (client-widths): a fused layer would keep the inputs of the client's width"
            )
        if self.client_widths is not None and self.settings.otfusion_reference == CLIENT:
            raise refuse(
                "otfusion-reference",
                CLIENT,
                "with clients of different widths (client-widths) the units are carried onto the global model: "
                "choose 'global'",
            )
        self.aligns_onto_client = self.settings.otfusion_reference == CLIENT
        self.global_width = self.spec.group_sizes(context.initial_arrays.to_torch_state_dict())
        """Units per permutation group: the fused model keeps the global model's widths, so they are the run's."""

    def narrow(self, state: dict[str, Tensor], template: dict[str, Tensor]) -> dict[str, Tensor]:
        """The global ``state`` at ``template``'s widths: its first units, or fused onto them by OT."""
        reference = first_units(state, template)
        if self.settings.otfusion_downsize == "slice":
            return reference
        return align_onto(reference, state, self.spec, self.ot)[0]

    def aggregate(self, server_round: int, replies: list[Reply], reference: ArrayRecord) -> Merge:
        """The fused average, with per group the share of transported mass off the diagonal (mean over the clients
        of the global width; 0: no unit moved) and the global width per group."""
        started = time.perf_counter()
        fused, maps = ot_fuse(reference.to_torch_state_dict(), *states_and_weights(replies), self.spec, self.ot)
        shares = [transport.off_diagonal() for transport in maps]
        groups = {group for share in shares for group in share}
        off_diagonal = {
            group: sum(s[group] for s in shares if group in s) / sum(group in s for s in shares) for group in groups
        }
        log(
            INFO,
            "round %d: fused %d client models by %s OT in %.2f s",
            server_round,
            len(replies),
            "exact" if self.ot.exact else f"Sinkhorn (reg {self.ot.reg})",
            time.perf_counter() - started,
        )
        return Merge(
            ArrayRecord(fused),
            [dict(transport.couplings) for transport in maps],
            metrics={"transport-off-diagonal": off_diagonal, "global-width": dict(self.global_width)},
        )


STRATEGIES.register(
    Algorithm(
        "otfusion",
        OTFusion,
        LocalUpdate,
        "carry client units onto the global model by optimal transport (exact or Sinkhorn), then average; "
        "takes clients of different widths",
        OTFusionSettings,
        paper="Singh and Jaggi, Model Fusion via Optimal Transport, NeurIPS 2020 (arXiv:1910.05653)",
    )
)
