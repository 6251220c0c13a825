"""Running jobs, whatever their kind: above every domain, below the API and the workers.

- :mod:`service.execution.kinds`: the one table from job kind to its body (by import path), queue
  and lane.
- :mod:`service.execution.runner`: the state machine every job goes through (heartbeats, retries,
  cancellation), the same in both modes.
- :mod:`service.execution.embedded`: embedded mode's job process and its live SQLite store.
- :mod:`service.execution.queues`: distributed mode's Celery app and sender.
- :mod:`service.execution.runtime`: one process's wiring (storage, job store, executor, duties).
"""
