"""The alignment engines: merging client models whose hidden units lie in different orders. Units are matched
one to one onto a reference (:mod:`~core.merging.alignment`, the references in :mod:`~core.merging.reference`)
or jointly into one universe (:mod:`~core.merging.universe`), matched by BBP-MAP so the model may grow
(:mod:`~core.merging.bbp`, over a whole model :mod:`~core.merging.bbp_model`), fused by optimal transport
(:mod:`~core.merging.ot_fusion`), and the merged units renormalised by REPAIR (:mod:`~core.merging.repair`). They
read state dicts and the model's permutation description only, nothing else of core."""
