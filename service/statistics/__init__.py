"""A concept's statistics on a model: their key and identity (``key``, ``spec``), the published
manifest and what it covers (``manifest``, ``cover``), and a worker's local copies (``local``)."""
