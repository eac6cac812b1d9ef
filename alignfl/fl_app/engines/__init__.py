"""Simulation engines beside Flower's: the batched engine (:mod:`alignfl.fl_app.engines.grid`), whose workers run a
round's messages at once (:mod:`alignfl.fl_app.engines.worker`), in this process or as Ray actors
(:mod:`alignfl.fl_app.engines.ray_workers`)."""
