"""Collecting rollouts: input rows, the chunk plan, parts, chunks, rollouts and progress.

Imports no Prefect.
"""
