"""Hydra sweeps: the sweep, its report, its tracking and the SLURM launcher."""
