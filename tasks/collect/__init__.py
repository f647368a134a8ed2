"""Collecting rollouts: input rows, the chunk plan, backend clients, retries, in-flight limit, verifiers.

Imports no Prefect.
"""
