"""Attacks on an edited model's forgetting: quantization round trips, relearning, rephrased probes.

Pure torch (and the ``gguf`` package's quantizers): no Celery, HTTP or storage. The evaluation job
(:mod:`service.evaluation.attacks`) applies them to a copy of each model it scores.
"""
