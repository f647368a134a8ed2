"""After collection: the audit, concatenation into the dataset, the run report and its plot.

Imports no Prefect.
"""
