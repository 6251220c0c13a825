"""Universes: the concept statistics an edit is measured against, decomposed once and stored."""
