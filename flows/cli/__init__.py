"""The `rollflow` command: argument parsing, exit codes and error display, progress, the demo.

It depends on the flows; no flow imports it.
"""
