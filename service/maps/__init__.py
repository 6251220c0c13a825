"""Memory-trace maps: where each concept's engram lives, by block and module type (the paper's Fig. 4)."""
