"""Emulated engines: real processes, sockets, weight bytes and scheduling; the model compute
replaced by a documented cost model (see cost.py). Imports neither torch nor vLLM."""
