"""The gateway's TOML: where the daemon is, where to listen, and model name -> local tokenizer directory.

Example (docs/GATEWAY.md)::

    [gateway]
    port = 8080
    instance = "default"          # daemon discovery, or daemon_endpoint = "ipc:///run/kvsched/default.sock"

    [[models]]
    name = "llama-3-8b"
    tokenizer_dir = "/models/llama-3-8b"   # tokenizer.json + chat template; nothing is downloaded
    max_model_len = 32768                  # prompt + max_tokens (tokens); more -> 400

The block size is not here, nor (unless as an override checked against it) the hash seed: block
hashes use the daemon's `Welcome.block_size` and `Welcome.hash_seed`.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta

from ..endpoints import connect_problem
from ..errors import ConfigError
from ..protocol import MAX_TOKENS

MAX_WORKERS = 256  # `workers` and `--workers`: gateway processes of one group


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of every table: an unknown key is an error."""


class GatewaySection(_Section):
    """`[gateway]`: listening address, daemon, limits (units in the names)."""

    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8080
    # Gateway processes sharing one listening socket, each its own router of the daemon; 0 = one
    # per CPU. Overridden by --workers.
    workers: Annotated[int, Meta(ge=0, le=MAX_WORKERS)] = 1
    daemon_endpoint: str = ""  # "" = discovery (KVSCHED_ENDPOINT, else the ipc path of `instance`)
    instance: str = "default"
    client_name: str = ""  # shown by `kvsched status` ("" = gateway-<pid>)
    max_body_bytes: Annotated[int, Meta(ge=1024)] = 4 * 1024 * 1024  # larger request bodies -> 413
    body_read_timeout_s: Annotated[float, Meta(gt=0)] = 30.0  # a body still incomplete after this -> 408 (s)
    max_prompt_tokens: Annotated[int, Meta(ge=1)] = 131_072  # longer prompts -> 400
    default_max_tokens: Annotated[int, Meta(ge=1)] = 256  # output tokens when the request names none
    # Optional override: what the daemon's `kv_hash_seed` (the pool's one hash seed, sent in its Welcome) must be;
    # while the daemon's differs, the gateway answers every request 503 `hash_seed_mismatch`. None = use the
    # daemon's, unchecked (docs/VLLM.md).
    hash_seed: str | None = None
    engine_connect_timeout_s: Annotated[float, Meta(gt=0)] = 5.0  # TCP connect to the engine (s)
    # Longest wait for the engine's response headers, and longest silence between two reads of its
    # stream (s); then the stream fails as an engine error.
    engine_read_timeout_s: Annotated[float, Meta(gt=0)] = 600.0
    health_interval_s: Annotated[float, Meta(gt=0)] = 2.0  # period of the engine health checks (s)
    health_timeout_s: Annotated[float, Meta(gt=0)] = 2.0  # one health check's timeout (s)
    health_path: str = "/health"  # vLLM's liveness endpoint
    # How long to wait at start for the daemon to bind its socket and answer (s); a gateway started
    # beside its daemon waits instead of exiting.
    connect_timeout_s: Annotated[float, Meta(gt=0)] = 10.0


class ModelSection(_Section):
    """`[[models]]`: a served model name and its local tokenizer directory."""

    name: Annotated[str, Meta(min_length=1)]
    tokenizer_dir: str  # holds tokenizer.json, and chat_template.jinja or tokenizer_config.json
    chat_template: str | None = None  # a template file overriding the directory's
    # The engine's context window (tokens, prompt + max_tokens; vLLM's --max-model-len): a request
    # asking for more answers 400 `context_length_exceeded` before it is scheduled.
    # At most MAX_TOKENS (2**31-1), the wire bound on expected_osl (a larger window would let max_tokens pass it).
    max_model_len: Annotated[int, Meta(ge=2, le=MAX_TOKENS)] = 32_768


class GatewayConfig(_Section):
    """The whole gateway file."""

    gateway: GatewaySection = msgspec.field(default_factory=GatewaySection)
    models: list[ModelSection] = msgspec.field(default_factory=list)


def load_gateway_config(path: str | Path) -> GatewayConfig:
    """Read and validate a gateway TOML file.

    Raises:
        ConfigError: unreadable file, bad TOML, unknown keys or wrong types (naming the key path), a
            malformed `daemon_endpoint`, no `[[models]]`, or a model name listed twice.
    """
    path = Path(path)
    try:
        with path.open("rb") as fh:
            raw = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8 text (toml.io)
        raise ConfigError(f"{path}: invalid TOML: not UTF-8 text (byte {exc.start})") from None
    try:
        cfg = msgspec.convert(raw, GatewayConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    problem = connect_problem(cfg.gateway.daemon_endpoint) if cfg.gateway.daemon_endpoint else None
    if problem is not None:
        raise ConfigError(
            f"{path}: gateway.daemon_endpoint = {cfg.gateway.daemon_endpoint!r}: {problem}; "
            "use ipc://PATH or tcp://HOST:PORT"
        )
    if not cfg.models:
        raise ConfigError(f"{path}: no [[models]] table: the gateway needs at least one model")
    names = [m.name for m in cfg.models]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"{path}: model names listed twice: {sorted(dup)}")
    return cfg
