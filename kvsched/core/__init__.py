"""Pure, synchronous scheduling core (no I/O, no clock: time comes in as `now_us`).

Import the concrete modules (`kvsched.core.scheduler`, `.policy_queue`, `.request_queue`, ...);
this package file imports nothing so that `kvsched.core.types` stays cheap for the client.
"""
