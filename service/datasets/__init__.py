"""Concept datasets: records sent inline, uploaded as JSONL, or named by reference.

- :mod:`service.datasets.spool`: records normalised, counted, hashed and stored one at a time
  (``datasets/<sha256>.jsonl``), from a JSON body or an upload of any chunking.
- :mod:`service.datasets.refs`: a reference (``s3://``, ``hf://datasets/…``, ``file://``; JSONL or
  Parquet) checked in the API and resolved in the collection job into the same spool.
- :mod:`service.datasets.sources`: where a reference's bytes come from, its fingerprint, and the hub
  download cache.
"""
