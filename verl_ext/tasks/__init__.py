"""Example tasks for the CPU backend, each built locally (no download): :mod:`.arith`."""
