"""Choosing parallelism: probe steps, throughput measures, diagnose-bottleneck, tune-parallelism, adaptive.

Imports no Prefect.
"""
