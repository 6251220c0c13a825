"""Variants: submission, and the build by arithmetic on a universe's stored engrams."""
