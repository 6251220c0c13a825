"""Fixtures that the tests, the benchmarks and the scripts share; not part of the product.

- :mod:`engram_fixtures.demo`: the offline mini-TOFU demo (synthetic facts, a trained tokenizer, a
  tiny Llama trained on the facts, forget/retain probes); ``make demo`` runs it.
- :mod:`engram_fixtures.models`: builders of tiny, randomly initialised checkpoints of every
  architecture family the service edits.
- :mod:`engram_fixtures.live`: a real ``engram-service serve`` process on a free port, and the
  helpers that wait on its jobs.

The project installs this package beside ``service`` so that ``python -m engram_fixtures.demo``,
``bench/`` and ``scripts/`` find it, but ``service/`` and ``workers/`` never import it
(``tests/test_architecture.py``) and the images do not ship it (``.dockerignore``).
"""
