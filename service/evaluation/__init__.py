"""Evaluation and generation: run a variant and its base model on the user's probes, as jobs."""
