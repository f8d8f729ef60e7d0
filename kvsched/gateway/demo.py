"""`make gateway-demo`: daemon + three simulated engines + a gateway on one machine, until Ctrl-C.

Prints the curl commands to try. The model is "tiny" with a word-level tokenizer: prompts are made
of the words w0 ... w1999 (other words become [UNK] tokens); answers are filler words.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def admin_endpoint_for_any_shell(endpoint: str) -> str:
    """`endpoint` with a relative ipc path made absolute: the demo binds under its (relative)
    `--workdir`, but the line it prints is pasted into another shell, often in another directory."""
    if endpoint.startswith("ipc://") and not endpoint.startswith("ipc:///"):
        return "ipc://" + os.path.abspath(endpoint[len("ipc://") :])
    return endpoint


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvsched.gateway.demo", description=__doc__)
    ap.add_argument("--port", type=int, default=8080, help="gateway port (default 8080)")
    ap.add_argument("--engines", type=int, default=3, help="simulated engines (default 3)")
    ap.add_argument("--speedup", type=float, default=1.0, help="simulated time per wall time")
    ap.add_argument("--workdir", default="out/gateway-demo", help="logs and configs")
    args = ap.parse_args(argv)
    from .app import PortInUse, check_listen_address
    from .config import GatewaySection
    from .local_fleet import LocalFleet

    try:
        check_listen_address(GatewaySection().host, args.port)
    except PortInUse:
        sys.exit(
            f"gateway-demo: port {args.port} is already in use by another process. Choose another port:\n"
            f"  make gateway-demo GATEWAY_DEMO_PORT=18080\n"
            f"  .venv/bin/python -m kvsched.gateway.demo --port 18080\n"
            f"(and that port in the curl commands)"
        )
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    # Installed before anything starts, SIGHUP too: a closed terminal must stop the daemon, which runs
    # in its own session (the hangup never reaches it) and would keep its shared memory until someone
    # kills it. A signal to this process alone during start-up stops the fleet once it is up; a
    # terminal's Ctrl-C or hangup also reaches the engines and the gateway, so the start fails, and
    # that failure is reported as the interruption it is.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    print(f"starting daemon, {args.engines} simulated engines and a gateway (logs in {args.workdir}) ...")
    try:
        fleet = LocalFleet.start(args.workdir, n_engines=args.engines, speedup=args.speedup, gateway_port=args.port)
    except RuntimeError as exc:  # a process of the fleet failed to start: its log's tail is in the message
        if stop:  # it died of the same Ctrl-C / hangup (LocalFleet.start stops whatever it started)
            sys.exit("gateway-demo: interrupted while starting; everything it started is stopped")
        sys.exit(f"gateway-demo: {exc}")
    url = fleet.gateway_urls[0]
    assert fleet.daemon is not None, "LocalFleet.start starts the daemon"
    admin = admin_endpoint_for_any_shell(fleet.daemon.admin_endpoint)
    prompt = " ".join(f"w{i}" for i in range(64))  # 64 tokens: 4 blocks of 16 to cache
    print(
        f"""
gateway: {url}   engines: {", ".join(e.url for e in fleet.engines)}
admin:   KVSCHED_ADMIN_ENDPOINT={admin} .venv/bin/kvsched workers

curl -s {url}/v1/models
curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\
  -d '{{"model": "tiny", "max_tokens": 8, "messages": [{{"role": "user", "content": "{prompt}"}}]}}'
curl -sN {url}/v1/completions -H 'Content-Type: application/json' \\
  -d '{{"model": "tiny", "max_tokens": 8, "stream": true, "prompt": "w1 w2 w3 w4"}}'

Send the chat request twice: the second answer's usage shows prompt_tokens_details.cached_tokens.
Ctrl-C stops everything.""",
        flush=True,
    )
    try:
        while not stop:
            time.sleep(0.2)
    finally:
        print("stopping ...")
        fleet.stop()


if __name__ == "__main__":
    main()
