"""Many worker processes as one run: the share book, the worker-side collector, the engine channels."""
