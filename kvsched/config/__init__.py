"""The daemon's configuration: one TOML file, env `KVSCHED_<SECTION>_<KEY>` and a few flags on top.

`load_config(path, env, overrides)` is the only loader (defaults < file < env < flags). Every table is a
`Section` (unknown keys are errors naming their path). `examples/kvsched.toml` is kept equal to the
defaults (a test checks it). Endpoint discovery (`data_endpoint`, `admin_endpoint`, docs/DESIGN.md §1.2)
lives in `kvsched.endpoints`.

One module per job; import every name from `kvsched.config` itself:

* `sections`  the tree: `Config` and its sections, defaults, bounds, cross-field rules
* `checks`    engine URLs, the CURVE rule
* `loader`    file + `include` + environment + flags -> a validated `Config`; the endpoints the daemon
              would bind (`check_endpoints`, `--check-config`)
"""

from __future__ import annotations

from ..endpoints import endpoint_problem  # re-exported: callers validate endpoints beside config keys
from .checks import curve_problem, url_problem
from .loader import (
    NON_CONFIG_ENV,
    check_endpoints,
    config_env_names,
    config_from_dict,
    env_hint,
    ignored_env,
    load_config,
    load_config_keys,
    non_finite_keys,
)
from .sections import (
    AdmissionConfig,
    ClassConfig,
    Config,
    DaemonConfig,
    OverloadConfig,
    Section,
    Seed,
    SelectorConfig,
    TokenCount,
    WorkerConfig,
)

__all__ = [
    "NON_CONFIG_ENV",
    "AdmissionConfig",
    "ClassConfig",
    "Config",
    "DaemonConfig",
    "OverloadConfig",
    "Section",
    "Seed",
    "SelectorConfig",
    "TokenCount",
    "WorkerConfig",
    "check_endpoints",
    "config_env_names",
    "config_from_dict",
    "curve_problem",
    "endpoint_problem",
    "env_hint",
    "ignored_env",
    "load_config",
    "load_config_keys",
    "non_finite_keys",
    "url_problem",
]
