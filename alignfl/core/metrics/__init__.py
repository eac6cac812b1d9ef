"""What is measured of trained models beyond their loss and accuracy: calibration (ECE, MCE;
:mod:`~alignfl.core.metrics.calibration`), several models scored alone and as an ensemble
(:mod:`~alignfl.core.metrics.ensemble`) and how far the clients' models spread around their mean
(:mod:`~alignfl.core.metrics.divergence`)."""
