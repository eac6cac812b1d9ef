"""The server's round machinery: the nodes and their partitions (:mod:`~core.rounds.nodes`), what messages carry
and the checks a reply passes (:mod:`~core.rounds.replies`), an algorithm's server side
(:mod:`~core.rounds.strategy`) with its models at the clients' widths (:mod:`~core.rounds.sub_models`), REPAIR's
statistics round (:mod:`~core.rounds.repair_round`) and the round runner that drives them all
(:mod:`~core.rounds.runner`)."""
