"""Config loading: example file equals defaults, errors name file and key, env overrides, discovery."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsched.config import Config, load_config
from kvsched.endpoints import admin_endpoint, data_endpoint
from kvsched.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_example_config_equals_the_defaults():
    assert load_config(ROOT / "examples" / "kvsched.toml", env={}) == Config()


def test_multiclass_example_profile_is_valid():
    cfg = load_config(ROOT / "examples" / "profile-multiclass.toml", env={})
    assert [c.name for c in cfg.classes] == ["latency", "agents", "batch"]
    assert cfg.classes[1].admission.type == "session_cap"


def test_unknown_key_is_an_error_naming_file_and_path(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[daemon]\nblock_sise = 16\n")
    with pytest.raises(ConfigError, match=r"bad\.toml.*block_sise.*daemon"):
        load_config(bad, env={})


def test_out_of_range_value_is_an_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[[classes]]\nname = 'default'\nquantum = 0\n")
    with pytest.raises(ConfigError, match="quantum"):
        load_config(bad, env={})


@pytest.mark.parametrize("url", ["10.0.0.5:8000", "notaurl", "http://", "http://a:99999"])
def test_worker_url_without_http_scheme_and_host_is_an_error(tmp_path, url):
    bad = tmp_path / "bad.toml"
    bad.write_text(f"[[workers]]\nworker_id = 1\nurl = '{url}'\n")
    with pytest.raises(ConfigError, match=r"workers\[worker_id=1\]\.url"):
        load_config(bad, env={})
    good = tmp_path / "good.toml"
    good.write_text("[[workers]]\nworker_id = 1\nurl = 'http://10.0.0.5:8000'\n")
    assert load_config(good, env={}).workers[0].url == "http://10.0.0.5:8000"


def test_config_that_is_not_utf8_is_a_config_error_and_check_config_exits_2(tmp_path):
    """Was: a UnicodeDecodeError traceback from `kvsched-daemon --check-config` (exit 1)."""
    import subprocess
    import sys

    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"[daemon]\nblock_size = 16 # \xb5s\n")
    with pytest.raises(ConfigError, match=r"latin1\.toml.*not UTF-8"):
        load_config(bad, env={})
    proc = subprocess.run(
        [sys.executable, "-m", "kvsched.daemon.app", "--check-config", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "not UTF-8" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_default_class_must_exist(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("default_class = 'nope'\n")
    with pytest.raises(ConfigError, match="default_class"):
        load_config(bad, env={})


def test_env_overrides_file_and_flags_override_env(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[daemon]\nblock_size = 32\n")
    assert load_config(f, env={}).daemon.block_size == 32
    assert load_config(f, env={"KVSCHED_DAEMON_BLOCK_SIZE": "64"}).daemon.block_size == 64
    cfg = load_config(f, env={"KVSCHED_DAEMON_BLOCK_SIZE": "64"}, overrides={"daemon": {"block_size": 128}})
    assert cfg.daemon.block_size == 128
    with pytest.raises(ConfigError, match="KVSCHED_DAEMON_NOPE"):
        load_config(f, env={"KVSCHED_DAEMON_NOPE": "1"})


@pytest.mark.parametrize(
    "name", ["KVSCHED_DEAMON_MAX_SLOTS", "KVSCHED_SELECTR_TYPE", "KVSCHED_WORKERS_TOTAL_KV_BLOCKS"]
)
def test_env_variable_naming_no_settable_section_is_ignored_and_reported(name):
    """A typo in the section (`KVSCHED_DEAMON_MAX_SLOTS=5`) no longer stops the daemon (an unknown
    variable must not: Kubernetes injects KVSCHED_<SERVICE>_* names); the daemon warns about it."""
    from kvsched.config import ignored_env

    assert load_config(None, env={name: "5"}) == load_config(None, env={})
    assert ignored_env({name: "5"}) == ([], [name])


SERVICE_LINKS = {  # what a Service named kvsched-pool with ports 7000 (named data) and 9464 puts into a pod
    "KVSCHED_POOL_SERVICE_HOST": "10.0.0.1",
    "KVSCHED_POOL_SERVICE_PORT": "7000",
    "KVSCHED_POOL_SERVICE_PORT_DATA": "7000",
    "KVSCHED_POOL_PORT": "tcp://10.0.0.1:7000",
    "KVSCHED_POOL_PORT_7000_TCP": "tcp://10.0.0.1:7000",
    "KVSCHED_POOL_PORT_7000_TCP_PROTO": "tcp",
    "KVSCHED_POOL_PORT_7000_TCP_PORT": "7000",
    "KVSCHED_POOL_PORT_7000_TCP_ADDR": "10.0.0.1",
    "KVSCHED_POOL_PORT_9464_UDP_ADDR": "10.0.0.1",
    "KVSCHED_POOL_PORT_9464_SCTP": "sctp://10.0.0.1:9464",
    # a Service named kvsched-daemon: a settable section, but a service link, not a key of it
    "KVSCHED_DAEMON_SERVICE_HOST": "10.0.0.2",
    "KVSCHED_DAEMON_PORT": "tcp://10.0.0.2:7000",
}


def test_kubernetes_service_links_are_ignored_but_a_known_key_is_always_read():
    """Service links load as if absent (reported apart, for a debug line); KVSCHED_DAEMON_METRICS_PORT
    ends in _PORT yet names a key: read. A settable section with an unknown key is still an error,
    and the error names only the variables users set (not the debug, bench and test ones)."""
    from kvsched.config import ignored_env

    env = SERVICE_LINKS | {"KVSCHED_DAEMON_METRICS_PORT": "9464"}
    assert load_config(None, env=env).daemon.metrics_port == 9464
    assert ignored_env(env) == (sorted(SERVICE_LINKS), [])
    with pytest.raises(ConfigError, match=r"KVSCHED_DAEMON_MAX_SLOTZ: unknown key daemon.max_slotz") as err:
        load_config(None, env=SERVICE_LINKS | {"KVSCHED_DAEMON_MAX_SLOTZ": "5"})
    assert "KVSCHED_ADMIN_ENDPOINT" in str(err.value)
    for internal in ("KVSCHED_DEBUG_STALL_S", "KVSCHED_BENCH_CORE_SRC", "KVSCHED_REGEN_GOLDEN"):
        assert internal not in str(err.value)


def test_the_documented_non_config_variables_are_left_alone():
    """Every other KVSCHED_ variable the code, docs and deploy files use still loads (discovery,
    debug, compose, bench, tests) without a warning."""
    from kvsched.config import NON_CONFIG_ENV, ignored_env

    env = {name: "x" for name in NON_CONFIG_ENV} | {"KVSCHED_TAG": "latest", "KVSCHED_DAEMON_MAX_SLOTS": "5"}
    assert load_config(None, env=env).daemon.max_slots == 5
    assert ignored_env(env) == ([], [])


def test_include_supplies_the_profile(tmp_path):
    (tmp_path / "profile.toml").write_text("default_class = 'a'\n[[classes]]\nname = 'a'\nquantum = 7\n")
    main = tmp_path / "main.toml"
    main.write_text("include = 'profile.toml'\n")
    cfg = load_config(main, env={})
    assert cfg.default_class == "a" and cfg.classes[0].quantum == 7


def test_discovery_prefers_env_then_config_then_runtime_dir():
    assert data_endpoint("x", "", {"KVSCHED_ENDPOINT": "tcp://127.0.0.1:1"}) == "tcp://127.0.0.1:1"
    assert data_endpoint("x", "ipc:///a.sock", {}) == "ipc:///a.sock"
    ep = data_endpoint("pool", "", {"XDG_RUNTIME_DIR": "/run/user/7"})
    assert ep.endswith("/pool.sock")
    assert admin_endpoint("pool", "", {"XDG_RUNTIME_DIR": "/run/user/7"}).endswith("/pool-admin.sock")


def test_the_daemon_binds_its_configured_endpoints_before_the_discovery_variables():
    """KVSCHED_ENDPOINT / KVSCHED_ADMIN_ENDPOINT tell routers and the CLI where to connect; a daemon
    whose config names its endpoints binds those (was: the variables won, so an exported
    KVSCHED_ADMIN_ENDPOINT moved a second instance onto the first one's socket)."""
    from kvsched.endpoints import daemon_endpoints

    env = {
        "KVSCHED_ENDPOINT": "ipc:///env/d.sock",
        "KVSCHED_ADMIN_ENDPOINT": "ipc:///env/a.sock",
        "XDG_RUNTIME_DIR": "/run/user/7",
    }
    assert daemon_endpoints("p", "ipc:///cfg/d.sock", "ipc:///cfg/a.sock", env) == (
        ("ipc:///cfg/d.sock", "config"),
        ("ipc:///cfg/a.sock", "config"),
    )
    assert daemon_endpoints("p", "", "ipc:///cfg/a.sock", env) == (
        ("ipc:///env/d.sock", "KVSCHED_ENDPOINT"),
        ("ipc:///cfg/a.sock", "config"),
    )
    assert daemon_endpoints("p", "", "", {"XDG_RUNTIME_DIR": "/run/user/7"})[1][1] == "discovery"


def test_check_config_ignores_a_discovery_variable_the_configured_endpoint_overrides(tmp_path):
    """--check-config checks the endpoints the daemon would bind: a malformed KVSCHED_ENDPOINT does
    not matter to a daemon whose config names its endpoint; it does when the config leaves it ""."""
    from kvsched.config import check_endpoints

    named = tmp_path / "named.toml"
    named.write_text('[daemon]\nendpoint = "ipc:///tmp/x.sock"\n')
    env = {"KVSCHED_ENDPOINT": "tcp://nohost"}
    assert check_endpoints(load_config(named, env={}), env) == []
    problems = check_endpoints(load_config(None, env={}), env)
    assert problems and "tcp://nohost" in problems[0]


@pytest.mark.parametrize(
    "key, value", [("total_kv_blocks", 2**62), ("total_kv_blocks", 2**40 + 1), ("max_num_batched_tokens", 2**31)]
)
def test_worker_capacity_over_its_bound_is_a_config_error_naming_the_key(tmp_path, key, value):
    """Was: `total_kv_blocks = 4611686018427387904` passed `--check-config` (and a start)."""
    path = tmp_path / "big.toml"
    path.write_text(f"[[workers]]\nworker_id = 0\n{key} = {value}\n")
    with pytest.raises(ConfigError, match=rf"{key}"):
        load_config(path, env={})


def test_duplicate_worker_id_is_named(tmp_path):
    """Was: "duplicate worker_id in [[workers]]" without saying which."""
    path = tmp_path / "dup.toml"
    path.write_text("".join(f"[[workers]]\nworker_id = {w}\n" for w in (0, 7, 3, 7)))
    with pytest.raises(ConfigError, match=r"duplicate worker_id in \[\[workers\]\]: 7$"):
        load_config(path, env={})


@pytest.mark.parametrize(
    "text, bad",
    [
        ("default_clas = 'a'\n", "default_clas"),
        ("[[clases]]\nname = 'a'\n", "clases"),
        ("[daemon]\nmax_slots = 5\n", "daemon"),
    ],
)
def test_an_unknown_key_in_an_included_file_is_an_error_naming_file_and_key(tmp_path, text, bad):
    """Found from outside: the loader copied only default_class / classes from the included file, so
    a typo there (or a [daemon] table) passed --check-config and the built-in profile was used."""
    (tmp_path / "p1.toml").write_text(text)
    main = tmp_path / "main.toml"
    main.write_text("include = 'p1.toml'\n")
    with pytest.raises(ConfigError) as info:
        load_config(main, env={})
    msg = str(info.value)
    assert str(tmp_path / "p1.toml") in msg and f"unknown key {bad}:" in msg
    assert "default_class and [[classes]]" in msg  # what an include may hold


def test_a_nested_include_is_refused_naming_both_files(tmp_path):
    (tmp_path / "p2.toml").write_text("default_class = 'b'\n[[classes]]\nname = 'b'\n")
    (tmp_path / "p1.toml").write_text("include = 'p2.toml'\n")
    main = tmp_path / "main.toml"
    main.write_text("include = 'p1.toml'\n")
    with pytest.raises(ConfigError, match="cannot include another") as info:
        load_config(main, env={})
    assert str(tmp_path / "p1.toml") in str(info.value) and str(main) in str(info.value)
    (tmp_path / "p1.toml").write_text("include = 'p1.toml'\n")  # a cycle: the same error, no recursion
    with pytest.raises(ConfigError, match="cannot include another"):
        load_config(main, env={})


def test_an_error_in_an_included_class_names_the_included_file(tmp_path):
    (tmp_path / "p1.toml").write_text("default_class = 'a'\n[[classes]]\nname = 'a'\nqantum = 7\n")
    main = tmp_path / "main.toml"
    main.write_text("include = 'p1.toml'\n")
    with pytest.raises(ConfigError, match=r"qantum") as info:
        load_config(main, env={})
    assert str(tmp_path / "p1.toml") in str(info.value)


def test_the_including_file_keeps_its_own_profile(tmp_path):
    (tmp_path / "p1.toml").write_text("default_class = 'a'\n[[classes]]\nname = 'a'\n")
    main = tmp_path / "main.toml"
    main.write_text("include = 'p1.toml'\ndefault_class = 'b'\n[[classes]]\nname = 'b'\n")
    cfg = load_config(main, env={})
    assert cfg.default_class == "b" and [c.name for c in cfg.classes] == ["b"]


def test_an_ipc_path_longer_than_a_unix_socket_address_is_an_endpoint_problem_everywhere():
    """One check for every endpoint (daemon, workers' KV-event endpoints, add-worker, clients): a bind
    or connect to a path over 107 bytes fails (unix(7)); found where --check-config passed one."""
    from kvsched.endpoints import MAX_IPC_PATH_BYTES, endpoint_problem

    ok = "ipc:///" + "x" * (MAX_IPC_PATH_BYTES - 1)
    assert endpoint_problem(ok) is None
    assert "at most 107" in endpoint_problem(ok + "x")
    with pytest.raises(ConfigError, match="kv_events_endpoint"):
        load_config(None, env={}, overrides={"workers": [{"worker_id": 1, "kv_events_endpoint": ok + "x"}]})
