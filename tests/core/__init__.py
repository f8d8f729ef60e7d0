"""Pure unit and property tests of kvsched.core (docs/DESIGN.md §10.5)."""
