"""Where data lives: the fsspec store, the run ledger and chunk manifests, the run lease.

Imports no Prefect.
"""
