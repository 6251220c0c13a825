"""Helpers that test modules share: no test module imports another (``tests/test_architecture.py``).

- :mod:`tests.helpers.api`: what a request to the live API must answer and leave unchanged.
- :mod:`tests.helpers.cli`: the ``engram`` CLI run as a subprocess, and what its exit must look like.
- :mod:`tests.helpers.job_process`: a live server's job process, found, paused and measured.
- :mod:`tests.helpers.algebra`: float64 references of the engram algebra and their tolerances.
- :mod:`tests.helpers.collection`: the engine's collection path and records of mixed lengths.
- :mod:`tests.helpers.variants`: a store world with published concepts, variants built from it
  and the float64 edit they must equal.

The live server, Redis and worker processes are :mod:`engram_fixtures.live`; the in-process store
world is :mod:`tests.helpers.store_world`; SeaweedFS is :mod:`tests.helpers.s3`.
"""
