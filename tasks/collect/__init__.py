"""Collecting rollouts: input rows, the chunk plan, backends, retries, in-flight limit, parts, verifiers.

Imports no Prefect.
"""
