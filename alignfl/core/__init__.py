"""The core layer beneath the algorithms (imports models and plugins only), in wings by job: the data sets and
their partitioning, the run's settings, model widths and what a model sends and receives, training, metrics, the
merging engines and the round machinery; ``pyproject.toml``'s import-linter contract orders them."""
