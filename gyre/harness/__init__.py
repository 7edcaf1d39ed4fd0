"""Harnesses: run unmodified agents per execution (runners), isolated (sandboxes), with timeouts (execution).

See docs/harness.md. `gyre.harness.protocol` holds the contract; importing the package imports nothing heavy.
"""
