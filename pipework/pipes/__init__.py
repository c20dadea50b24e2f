"""Pipes, stages, snapshot and merge: what a chain is made of. Knows nothing of HTTP."""
