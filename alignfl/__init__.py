"""alignfl: federated learning under non-IID data with neuron alignment, as a Flower app and a library.

Its sub-packages, in layers (each imports only those below it; ``pyproject.toml``'s import-linter contracts keep
them so):

* :mod:`alignfl.fl_app`: what ``flwr run`` loads (ServerApp, ClientApp, run config), the launcher, deployment,
  simulation engines, Hydra sweeps and the offline analysis tools;
* :mod:`alignfl.strategies`: one module per federated algorithm (its settings, server side and client update);
* :mod:`alignfl.core`: data sets and partitioning, the run's settings, training, metrics, the merging engines and
  the round machinery;
* :mod:`alignfl.models`: the networks, the PAN layer and each model's permutation symmetry;
* :mod:`alignfl.plugins`: how every part declares its settings and registers itself.
"""
