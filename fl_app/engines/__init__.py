"""Simulation engines beside Flower's: the batched engine (:mod:`fl_app.engines.grid`), whose workers run a
round's messages at once (:mod:`fl_app.engines.worker`), in this process or as Ray actors
(:mod:`fl_app.engines.ray_workers`)."""
