"""Per-member engrams of a universe: computed once when it is built, read by every variant."""
