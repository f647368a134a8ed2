"""Where Prefect begins under tasks/: thin @task wrappers that call the plain cores of the other rooms, and
the module a Dask worker preloads. Everything else under tasks/ imports no Prefect.
"""
