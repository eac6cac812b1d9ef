"""The alignment engines: merging client models whose hidden units lie in different orders. Units are matched
one to one onto a reference (:mod:`~alignfl.core.merging.alignment`, the references in
:mod:`~alignfl.core.merging.reference`) or jointly into one universe (:mod:`~alignfl.core.merging.universe`), matched by
BBP-MAP so the model may grow (:mod:`~alignfl.core.merging.bbp`, over a whole model
:mod:`~alignfl.core.merging.bbp_model`), fused by optimal transport (:mod:`~alignfl.core.merging.ot_fusion`), and the
merged units renormalised by REPAIR (:mod:`~alignfl.core.merging.repair`). They read state dicts and the model's
permutation description only, nothing else of core."""
