"""Pure unit and property tests of kvsched.core (STYLE §10)."""
