"""The server's round machinery: the nodes and their partitions (:mod:`~alignfl.core.rounds.nodes`), what messages carry
and the checks a reply passes (:mod:`~alignfl.core.rounds.replies`), an algorithm's server side
(:mod:`~alignfl.core.rounds.strategy`) with its models at the clients' widths (:mod:`~alignfl.core.rounds.sub_models`),
REPAIR's statistics round (:mod:`~alignfl.core.rounds.repair_round`) and the round runner that drives them all
(:mod:`~alignfl.core.rounds.runner`)."""
