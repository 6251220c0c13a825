"""One module per resource of the service, each a mixin of :class:`~engram_client.EngramClient` over
the one :class:`~engram_client.transport.Transport`: models (and the probes), concepts, jobs,
universes, variants (unlearn, compose), files (downloads), evaluation (and generation), maps and
calibration."""
