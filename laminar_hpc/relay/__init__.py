"""Relay tier: MPI chain broadcast and node-local weight stores."""
