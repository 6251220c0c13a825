"""Jobs: their records (store), the runner that takes one to a final state, the queues that carry them, and their duties."""
