"""Where data lives: the fsspec store, the run ledger and chunk manifests, partial parts, the run lease."""
