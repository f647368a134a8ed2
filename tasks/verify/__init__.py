"""Rewards: the verifiers, and the process pool that runs CPU-bound checks with a timeout."""
