"""Python client and `engram` CLI for the Engram Service HTTP API."""
