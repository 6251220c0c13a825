"""Concepts: their records and datasets, submitted and viewed; the collection job that measures their statistics."""
