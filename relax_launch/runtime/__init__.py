"""Runtime: wire one torchrun job together (process groups, roles, control channel)."""
