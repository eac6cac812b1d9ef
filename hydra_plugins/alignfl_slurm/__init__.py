"""Hydra instantiates launchers only from classes defined in the ``hydra_plugins`` namespace package: alignfl's
SLURM launcher (:class:`fl_app.slurm.SlurmLauncher`), as Hydra finds it."""

from fl_app import slurm


class SlurmLauncher(slurm.SlurmLauncher):
    """:class:`fl_app.slurm.SlurmLauncher` under the name Hydra accepts."""
