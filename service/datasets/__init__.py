"""Concept datasets: records sent inline, uploaded as JSONL, or named by reference.

- :mod:`service.datasets.spool`: records normalised, counted, hashed and stored one at a time
  (``datasets/<sha256>.jsonl``), from a JSON body or an upload of any chunking.
- :mod:`service.datasets.refs`: a reference (``s3://``, ``hf://datasets/…``, ``file://``; JSONL or
  Parquet) checked in the API and resolved in the collection job into the same spool.
- :mod:`service.datasets.uris`, :mod:`~service.datasets.fingerprints`,
  :mod:`~service.datasets.sources`, :mod:`~service.datasets.hf_cache`: a reference's URI rules, the
  fingerprint of the content it names, the sources its bytes are read from (pinned to that
  content), and the hub download cache.
"""
