"""Calibration: find the edit strength, scaling and layers that meet a retain constraint, from probes."""
