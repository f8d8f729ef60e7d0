"""The gateway's TOML: the shipped deploy files load, mistakes are named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kvsched.errors import ConfigError
from kvsched.gateway.config import load_gateway_config

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_gateway_configs_load(tmp_path):
    cfg = load_gateway_config(ROOT / "deploy" / "config" / "gateway.toml")
    assert cfg.models[0].tokenizer_dir == "/models/tokenizer"
    for doc in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "configmap.yaml").read_text()):
        if doc and "gateway.toml" in doc.get("data", {}):
            (tmp_path / "g.toml").write_text(doc["data"]["gateway.toml"])
            assert load_gateway_config(tmp_path / "g.toml").models[0].name == cfg.models[0].name


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[gateway]\nport = 8080\n", "no [[models]]"),
        ('[[models]]\nname = "a"\ntokenizer = "/x"\n', "tokenizer"),
        ('[[models]]\nname = "a"\ntokenizer_dir = "/x"\n[[models]]\nname = "a"\ntokenizer_dir = "/y"\n', "twice"),
        ('[gateway]\nport = -1\n[[models]]\nname = "a"\ntokenizer_dir = "/x"\n', "port"),
        # was accepted, letting max_tokens pass the daemon's wire bound on expected_osl (2**31-1) -> 500
        ('[[models]]\nname = "a"\ntokenizer_dir = "/x"\nmax_model_len = 2147483648\n', "max_model_len"),
    ],
)
def test_bad_gateway_configs_name_the_problem(tmp_path, text, needle):
    path = tmp_path / "g.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_gateway_config(path)


def test_gateway_config_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "g.toml"
    path.write_bytes(b"[gateway]\nport = 8080 # \xb5\xff\n")  # Latin-1 bytes: was a UnicodeDecodeError
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_gateway_config(path)
