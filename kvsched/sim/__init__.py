"""Simulated fleet: the engine model, trace loaders and the two drivers (virtual time, wall clock).

`engine.SimEngine` is the one engine model; `virtual.run_virtual` drives it in virtual time with the
scheduler in process; `fleet` hosts engines in wall-clock time behind ZeroMQ for `replay`'s routers.
"""
