"""Where Prefect begins under tasks/: the @task wrappers and the wiring that opens a run (store, ledger,
limit, verifier) for the flows and for Dask workers. Everything else under tasks/ imports no Prefect.
"""
