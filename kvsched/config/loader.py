"""The loader: defaults < TOML file (with its `include`) < `KVSCHED_<SECTION>_<KEY>` environment <
flags, validated into a `Config`; every error is a `ConfigError` naming the file, key path and reason.
"""

from __future__ import annotations

import math
import os
import stat
import tomllib
from pathlib import Path
from typing import Any, Mapping

import msgspec

from ..errors import ConfigError
from .sections import Config, DaemonConfig, OverloadConfig, SelectorConfig


_ENV_PREFIX = "KVSCHED_"

# The KVSCHED_<X>_<Y> variables that are not config overrides (docs/DESIGN.md §1.3); the loader
# leaves them alone and refuses any other whose <X> is not a section it can set.
NON_CONFIG_ENV = frozenset({
    "KVSCHED_ENDPOINT", "KVSCHED_ADMIN_ENDPOINT",  # discovery of routers and the CLI (kvsched.endpoints)
    "KVSCHED_DEBUG_STALL_S",  # debug aid: SIGUSR2 blocks the daemon's loop this long (s)
    "KVSCHED_TOKENIZER_DIR",  # docker-compose.yml: the tokenizer mounted into engines and gateway
    "KVSCHED_BENCH_CORE_SRC", "KVSCHED_REGEN_GOLDEN",  # bench/ and tests/
})


def config_env_names(env: Mapping[str, str]) -> list[str]:
    """The `KVSCHED_<X>_<Y>` variables of `env` the loader reads as config overrides (or refuses as
    unknown sections): every `KVSCHED_` name with an inner `_` that is not one of `NON_CONFIG_ENV`.
    Sorted. A process that writes its daemon's whole config (`kvsched replay`) drops these."""
    return sorted(name for name in env if name.startswith(_ENV_PREFIX) and name not in NON_CONFIG_ENV
                  and "_" in name[len(_ENV_PREFIX):].strip("_"))


def _env_overrides(env: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """`KVSCHED_<SECTION>_<KEY>=value` → {section: {key: value}} for the scalar sections.

    Raises:
        ConfigError: an unknown key of a section, or a `KVSCHED_<X>_<Y>` variable whose X is not
            daemon, selector or overload and that is not one of `NON_CONFIG_ENV` (e.g. the typo
            `KVSCHED_DEAMON_MAX_SLOTS`, which would otherwise be ignored in silence).
    """
    out: dict[str, dict[str, Any]] = {}
    sections = {"daemon": DaemonConfig, "selector": SelectorConfig, "overload": OverloadConfig}
    for name, value in env.items():
        if not name.startswith(_ENV_PREFIX) or name in NON_CONFIG_ENV:
            continue
        rest = name[len(_ENV_PREFIX):].lower()
        section = next((s for s in sections if rest.startswith(s + "_")), None)
        if section is None:
            if "_" in rest.strip("_"):  # KVSCHED_<X>_<Y>: meant as an override of section X
                raise ConfigError(
                    f"environment {name}: {rest.split('_')[0]!r} is not a config section that can be set "
                    f"from the environment (KVSCHED_<SECTION>_<KEY> with SECTION one of "
                    f"{', '.join(s.upper() for s in sections)}); other KVSCHED_ variables kvsched reads: "
                    f"{', '.join(sorted(NON_CONFIG_ENV))}")
            continue
        key = rest[len(section) + 1:]
        if key not in sections[section].__struct_fields__:
            raise ConfigError(f"environment {name}: unknown key {section}.{key}")
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
            f"(one level only); move its default_class / [[classes]] into {path} or {parent}")
    unknown = [key for key in raw if key not in INCLUDABLE_KEYS]
    if unknown:
        raise ConfigError(
            f"{path} (included by {parent}): unknown key{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(unknown)}: an included file may hold only default_class and [[classes]] "
            f"(the other sections belong in {parent})")
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
        where += " + KVSCHED_* environment (" + ", ".join(
            f"KVSCHED_{sec.upper()}_{key.upper()}" for sec, keys in env_over.items() for key in keys) + ")"
    raw = _deep_merge(raw, env_over, where)
    if overrides:
        raw = _deep_merge(raw, overrides, where)
    return config_from_dict(raw, where), _set_keys(raw)


def _set_keys(raw: Mapping[str, Any]) -> frozenset[str]:
    """`section.key` for each key of a top-level table of `raw`, the name of every other top-level key."""
    out = set()
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
        raise ConfigError(f"{where}: " + "; ".join(f"{path} = {value!r}: expected a finite number"
                                                    for path, value in bad))
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
