"""`kvsched-gateway`: an OpenAI-compatible HTTP front that asks the daemon where each request runs.

Optional (`pip install 'kvsched[gateway]'`); the daemon does not depend on it. docs/GATEWAY.md
describes the contract (endpoints, headers, status codes, retries).
"""
