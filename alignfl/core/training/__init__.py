"""How a client's model trains: local SGD's pieces, one client at a time (:mod:`~alignfl.core.training.sgd`: device,
seeds, mini-batches, the optimiser and evaluation, which the server shares), and many clients' local SGD as one
computation (:mod:`~alignfl.core.training.vectorised`)."""
