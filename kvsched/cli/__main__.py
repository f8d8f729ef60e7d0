"""`python -m kvsched.cli` = `kvsched`."""

from . import main

main()
