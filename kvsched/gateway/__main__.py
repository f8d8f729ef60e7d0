"""`python -m kvsched.gateway` = `kvsched-gateway`."""

from .app import main

main()
