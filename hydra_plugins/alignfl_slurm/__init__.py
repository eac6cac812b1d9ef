"""Hydra instantiates launchers only from classes defined in the ``hydra_plugins`` namespace package: alignfl's
SLURM launcher (:class:`alignfl.fl_app.sweeps.slurm.SlurmLauncher`), as Hydra finds it."""

from alignfl.fl_app.sweeps import slurm


class SlurmLauncher(slurm.SlurmLauncher):
    """:class:`alignfl.fl_app.sweeps.slurm.SlurmLauncher` under the name Hydra accepts."""
