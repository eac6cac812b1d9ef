"""The core layer: data, partitioners, training loops, model io, calibration, the alignment engines and the round runner (imports models only)."""
