"""Object storage: the interface and its backends, the storage keys, and what a process keeps of stored objects."""
