"""The loader: defaults < TOML file (with its `include`) < `KVSCHED_<SECTION>_<KEY>` environment <
flags, validated into a `Config`; every error is a `ConfigError` naming the file, key path and reason.
"""

from __future__ import annotations

import math
import os
import re
import stat
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from ..endpoints import daemon_endpoints, endpoint_problem
from ..errors import ConfigError
from .checks import curve_problem
from .sections import Config, DaemonConfig, OverloadConfig, SelectorConfig

_ENV_PREFIX = "KVSCHED_"
_ENV_SECTIONS = {"daemon": DaemonConfig, "selector": SelectorConfig, "overload": OverloadConfig}

# The KVSCHED_ variables that are not config overrides (docs/DESIGN.md §1.3): the loader leaves them
# alone. Only the user-facing ones are named in its errors and warnings.
USER_ENV = frozenset(
    {
        "KVSCHED_ENDPOINT",
        "KVSCHED_ADMIN_ENDPOINT",  # discovery of routers and the CLI (kvsched.endpoints)
        "KVSCHED_TOKENIZER_DIR",
        "KVSCHED_TAG",  # docker-compose.yml: the tokenizer mount, the image tag
    }
)
INTERNAL_ENV = frozenset(
    {
        "KVSCHED_DEBUG_STALL_S",  # debug aid: SIGUSR2 blocks the daemon's loop this long (s)
        "KVSCHED_BENCH_CORE_SRC",
        "KVSCHED_REGEN_GOLDEN",  # bench/ and tests/
    }
)
NON_CONFIG_ENV = USER_ENV | INTERNAL_ENV

# The names Kubernetes gives the service links it puts into every pod of a namespace, for each
# Service: <NAME>_SERVICE_HOST, <NAME>_SERVICE_PORT, <NAME>_SERVICE_PORT_<PORT NAME>, <NAME>_PORT and
# <NAME>_PORT_<n>_<TCP|UDP|SCTP> with its _PROTO / _PORT / _ADDR forms ("Environment variables" in
# https://kubernetes.io/docs/concepts/services-networking/service/). A Service named kvsched-pool
# makes KVSCHED_POOL_SERVICE_HOST and the rest.
SERVICE_LINK = re.compile(
    r"_(?:SERVICE_HOST|SERVICE_PORT(?:_[A-Z0-9_]+)?|PORT(?:_[0-9]+_(?:TCP|UDP|SCTP)(?:_(?:PROTO|PORT|ADDR))?)?)$"
)

EnvKind = Literal["override", "non_config", "service_link", "unknown_key", "unknown"]


def env_kind(name: str) -> EnvKind:
    """What the loader does with the `KVSCHED_` variable `name`, first match wins:

    * `override`: `KVSCHED_<SECTION>_<KEY>` naming a key of [daemon], [selector] or [overload]: read
      (`KVSCHED_DAEMON_METRICS_PORT` too, though it looks like a service link);
    * `non_config`: one of `NON_CONFIG_ENV`, read elsewhere: left alone;
    * `service_link`: ends like a Kubernetes service link (`SERVICE_LINK`): ignored;
    * `unknown_key`: a settable section with a key it does not have (`KVSCHED_DAEMON_MAX_SLOTZ`): an error;
    * `unknown`: anything else (`KVSCHED_DEAMON_MAX_SLOTS`): ignored with a warning.
    """
    rest = name[len(_ENV_PREFIX) :].lower()
    section = next((s for s in _ENV_SECTIONS if rest.startswith(s + "_")), None)
    if section is not None and rest[len(section) + 1 :] in _ENV_SECTIONS[section].__struct_fields__:
        return "override"
    if name in NON_CONFIG_ENV:
        return "non_config"
    if SERVICE_LINK.search(name):
        return "service_link"
    return "unknown_key" if section is not None else "unknown"


def env_hint() -> str:
    """What kvsched reads from KVSCHED_ variables, for errors and warnings (user-facing ones only)."""
    return (
        f"KVSCHED_<SECTION>_<KEY> sets a key of a config section, SECTION one of "
        f"{', '.join(s.upper() for s in _ENV_SECTIONS)}; other KVSCHED_ variables kvsched reads: "
        f"{', '.join(sorted(USER_ENV))}"
    )


def config_env_names(env: Mapping[str, str]) -> list[str]:
    """The `KVSCHED_` variables of `env` the loader reads as config overrides or refuses (`env_kind`
    `override` or `unknown_key`). Sorted. A process that writes its daemon's whole config
    (`kvsched replay`) drops these."""
    return sorted(
        name for name in env if name.startswith(_ENV_PREFIX) and env_kind(name) in ("override", "unknown_key")
    )


def ignored_env(env: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """The `KVSCHED_` variables of `env` the loader ignores: (service links, unknown names), each
    sorted (`env_kind`). The daemon logs the first at debug level and warns once about each of the
    second; a stray variable never stops it (Kubernetes puts service links into every pod)."""
    kinds = {name: env_kind(name) for name in env if name.startswith(_ENV_PREFIX)}
    return (
        sorted(n for n, k in kinds.items() if k == "service_link"),
        sorted(n for n, k in kinds.items() if k == "unknown"),
    )


def _env_overrides(env: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """`KVSCHED_<SECTION>_<KEY>=value` → {section: {key: value}} for the scalar sections; every other
    `KVSCHED_` variable is left alone (`env_kind`), except the one error below.

    Raises:
        ConfigError: a settable section with an unknown key (`KVSCHED_DAEMON_MAX_SLOTZ`), unless
            the name ends like a Kubernetes service link.
    """
    out: dict[str, dict[str, Any]] = {}
    for name, value in env.items():
        if not name.startswith(_ENV_PREFIX):
            continue
        kind = env_kind(name)
        if kind not in ("override", "unknown_key"):
            continue
        rest = name[len(_ENV_PREFIX) :].lower()
        section = next(s for s in _ENV_SECTIONS if rest.startswith(s + "_"))
        key = rest[len(section) + 1 :]
        if kind == "unknown_key":
            raise ConfigError(f"environment {name}: unknown key {section}.{key} ({env_hint()})")
        out.setdefault(section, {})[key] = _parse_scalar(value)
    return out


def _parse_scalar(value: str) -> Any:
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any], where: str = "config", path: str = "") -> dict[str, Any]:
    """`top` merged into `base` (tables key by key). Raises ConfigError when `base` holds a non-table
    where `top` brings a table (`daemon = 5` in the file, a `--instance` flag on top): the override
    must not hide the file's error."""
    for key, value in top.items():
        if not isinstance(value, Mapping) or key not in base:
            base[key] = value
        elif isinstance(base[key], dict):
            _deep_merge(base[key], value, where, f"{path}{key}.")
        else:
            raise ConfigError(f"{where}: {path}{key} = {base[key]!r}: expected a table ([{path}{key}])")
    return base


MAX_CONFIG_BYTES = 1 << 20  # a config file larger than this is refused (bytes); profiles are a few KiB


def _read_toml(path: Path) -> dict[str, Any]:
    """Parse one TOML file: a regular file of at most `MAX_CONFIG_BYTES`, opened without blocking
    (a FIFO or a device named by mistake in `kvsched reload` must not stall the daemon's loop or
    make it read forever: tests/test_config_files.py).

    Raises:
        ConfigError: not readable, not a regular file, too large, or not valid UTF-8 TOML.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{path}: not a regular file (a config is a TOML file)")
        data = os.read(fd, MAX_CONFIG_BYTES + 1)  # one read: a regular file's size is known
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES:,} bytes; a config is a small TOML file")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    finally:
        os.close(fd)
    try:
        return tomllib.loads(data.decode("utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:  # TOML is UTF-8 text (toml.io)
        raise ConfigError(f"{path}: invalid TOML: not UTF-8 text (byte {exc.start})") from None


INCLUDABLE_KEYS = ("default_class", "classes")  # what an included file may hold: the scheduling profile


def _read_include(path: Path, parent: Path) -> dict[str, Any]:
    """Parse the file `parent`'s `include` names: a profile holding only `INCLUDABLE_KEYS`.

    Raises:
        ConfigError: naming `path`: unreadable or invalid TOML (`_read_toml`), a key other than
            `default_class` / `[[classes]]` (a typo such as `default_clas`, or a `[daemon]` table,
            would otherwise be ignored in silence), or an `include` of its own (one level only).
    """
    raw = _read_toml(path)
    if "include" in raw:
        raise ConfigError(
            f"{path}: include = {raw['include']!r}: a file included by {parent} cannot include another "
            f"(one level only); move its default_class / [[classes]] into {path} or {parent}"
        )
    unknown = [key for key in raw if key not in INCLUDABLE_KEYS]
    if unknown:
        raise ConfigError(
            f"{path} (included by {parent}): unknown key{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(unknown)}: an included file may hold only default_class and [[classes]] "
            f"(the other sections belong in {parent})"
        )
    return raw


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Load and validate the configuration (defaults < file < env < overrides); `load_config_keys`
    documents the arguments and errors."""
    return load_config_keys(path, env, overrides)[0]


def load_config_keys(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[Config, frozenset[str]]:
    """Load and validate the configuration (defaults < file < env < overrides), and say which keys
    those sources set (the rest are defaults): what `kvsched reload` compares with the running config.

    Args:
        path: TOML file, or None for defaults only. An `include = "profile.toml"` key (relative to
            the file) supplies `default_class` / `[[classes]]` unless the file sets them itself; the
            included file may hold nothing else and no `include` of its own (`_read_include`).
        env: environment mapping (default `os.environ`); `KVSCHED_DAEMON_BLOCK_SIZE=512` etc.
        overrides: nested dict from CLI flags, e.g. {"daemon": {"instance": "pool-a"}}.
    Returns:
        (a validated `Config`, the set keys): `section.key` for each key of a table (`daemon.max_slots`),
        the bare name of any other top-level key (`workers`, `classes`, `default_class`).
    Raises:
        ConfigError: naming the file, key path and reason.
    """
    raw: dict[str, Any] = {}
    where = "defaults"
    if path is not None:
        p = Path(path)
        where = str(p)
        raw = _read_toml(p)
        inc = raw.get("include")
        if isinstance(inc, str):
            inc_path = (p.parent / inc).resolve()
            supplied = []
            for key, value in _read_include(inc_path, p).items():
                if key not in raw:  # the including file's own profile wins
                    raw[key] = value
                    supplied.append(key)
            if supplied:  # errors in what the include supplied name the file it came from
                where += f" ({' and '.join(supplied)} from {inc_path})"
    env_over = _env_overrides(os.environ if env is None else env)
    if env_over:
        where += (
            " + KVSCHED_* environment ("
            + ", ".join(f"KVSCHED_{sec.upper()}_{key.upper()}" for sec, keys in env_over.items() for key in keys)
            + ")"
        )
    raw = _deep_merge(raw, env_over, where)
    if overrides:
        raw = _deep_merge(raw, overrides, where)
    return config_from_dict(raw, where), _set_keys(raw)


def _set_keys(raw: Mapping[str, Any]) -> frozenset[str]:
    """`section.key` for each key of a top-level table of `raw`, the name of every other top-level key."""
    out: set[str] = set()
    for top, value in raw.items():
        if isinstance(value, Mapping):
            out.update(f"{top}.{key}" for key in value)
        else:
            out.add(top)
    return frozenset(out)


def config_from_dict(raw: Mapping[str, Any], where: str = "config") -> Config:
    """Validate a plain dict (as parsed from TOML) into a `Config`; errors name `where` and the path.

    Beyond the per-key types and bounds, every float key must be finite (`non_finite_keys`): TOML
    allows `inf` / `-inf`, and an infinite weight makes every cost inf/NaN.
    """
    try:
        cfg = msgspec.convert(raw, Config, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    except ValueError as exc:  # __post_init__ cross-field checks
        raise ConfigError(f"{where}: {exc}") from exc
    bad = non_finite_keys(cfg)
    if bad:
        raise ConfigError(
            f"{where}: " + "; ".join(f"{path} = {value!r}: expected a finite number" for path, value in bad)
        )
    return cfg


def non_finite_keys(node: Any, path: str = "") -> list[tuple[str, float]]:
    """(key path, value) of every float field that is inf, -inf or NaN in a config tree of `msgspec.Struct`s
    and lists of them (e.g. `("selector.temperature", inf)`, `("classes[0].queue_timeout_s", -inf)`)."""
    out: list[tuple[str, float]] = []
    if isinstance(node, msgspec.Struct):
        for name in node.__struct_fields__:
            out += non_finite_keys(getattr(node, name), f"{path}.{name}" if path else name)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            out += non_finite_keys(item, f"{path}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        out.append((path, node))
    return out


def check_endpoints(cfg: Config, env: Mapping[str, str] | None = None) -> list[str]:
    """Problems of the endpoints the daemon would really use (discovery and `KVSCHED_*ENDPOINT`
    included): syntax (ipc path length too, `endpoint_problem`), the CURVE rule, and addresses a start
    could not bind (data = admin, an endpoint on the metrics host:port). [] = fine. Used by
    `kvsched-daemon --check-config`."""
    d = cfg.daemon
    problems = []
    (data, _), (admin, _) = daemon_endpoints(d.instance, d.endpoint, d.admin_endpoint, env)
    wild = ("*", "0.0.0.0", "")
    for what, ep in (("data endpoint", data), ("admin endpoint", admin)):
        problem = endpoint_problem(ep) or curve_problem(ep, d.curve_secret_key_file)
        if problem:
            problems.append(f"{what} {ep!r}: {problem}")
        host, _, port = ep[len("tcp://") :].rpartition(":") if ep.startswith("tcp://") else ("", "", "")
        if (
            d.metrics_port
            and port == str(d.metrics_port)
            and (host == d.metrics_host or host in wild or d.metrics_host in wild)
        ):
            problems.append(f"the {what} and daemon.metrics_host/metrics_port both use {host}:{port}")
    if data == admin:
        problems.append(f"the data and admin endpoints are the same ({data!r}): each needs its own socket")
    if d.curve_secret_key_file and not Path(d.curve_secret_key_file).is_file():
        problems.append(f"daemon.curve_secret_key_file {d.curve_secret_key_file}: no such file")
    return problems
