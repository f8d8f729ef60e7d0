"""A model's tokenizer and chat template, from a local directory (nothing is downloaded).

The directory holds `tokenizer.json` (Hugging Face `tokenizers` format) and the chat template as
`chat_template.jinja` or under the `chat_template` key of `tokenizer_config.json` (the two places
Hugging Face model repositories keep it). Templates render with jinja2's sandbox, with the
variables Hugging Face templates expect: `messages`, `add_generation_prompt`, `bos_token`,
`eos_token`, `raise_exception`. Used by the gateway and by the simulated HTTP engine, so both count
the same tokens and compute the same block hashes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from ..errors import ConfigError


class TemplateError(ValueError):
    """The chat template refused the messages (its `raise_exception`, or a rendering error)."""


def _raise(message: str) -> None:
    raise TemplateError(message)


class ModelTokenizer:
    """Tokenizer + chat template of one model.

    Args:
        tokenizer_dir: directory with tokenizer.json (and the template, module docstring).
        chat_template: a template file to use instead of the directory's.
    Raises:
        ConfigError: a missing tokenizer directory or tokenizer.json, an unreadable `chat_template` or other
            file, or a template that does not compile; the message names the path.
    """

    def __init__(self, tokenizer_dir: str | Path, chat_template: str | Path | None = None) -> None:
        d = Path(tokenizer_dir)
        tok_file = d / "tokenizer.json"
        if not tok_file.is_file():
            why = "no tokenizer.json there" if d.is_dir() else "no such directory"
            raise ConfigError(f"tokenizer directory {str(d)!r}: {why} (tokenizers are read from local directories)")
        try:
            self.tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust side raises plain Exception
            raise ConfigError(f"{tok_file}: {exc}") from None
        self._encode_fast = getattr(self.tokenizer, "encode_batch_fast", None)
        config: dict[str, Any] = {}
        cfg_file = d / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                config = json.loads(cfg_file.read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError(f"{cfg_file}: {exc}") from None
        source, origin = None, ""  # origin: where the template came from, for a compile error
        if chat_template is not None:
            origin = f"chat_template = {str(chat_template)!r}"
            try:
                source = Path(chat_template).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                raise ConfigError(f"chat_template = {str(chat_template)!r}: cannot read it: {why}") from None
        elif (d / "chat_template.jinja").is_file():
            source, origin = (d / "chat_template.jinja").read_text(), str(d / "chat_template.jinja")
        elif isinstance(config.get("chat_template"), str):
            source, origin = config["chat_template"], f"{cfg_file} (its chat_template)"
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.template = None
        if source is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            try:
                self.template = env.from_string(source)
            except Exception as exc:
                raise ConfigError(f"{origin}: chat template does not compile: {exc}") from None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of a chat request.

        Raises:
            TemplateError: no chat template, or the template rejected the messages.
        """
        if self.template is None:
            raise TemplateError("this model has no chat template; use /v1/completions")
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError:
            raise
        except Exception as exc:
            raise TemplateError(f"chat template failed: {exc}") from None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text` (chat prompts already hold their special tokens: add none).

        Uses `Tokenizer.encode_batch_fast` where the installed `tokenizers` has it (0.21 and
        later): the same ids without computing character offsets, which nothing here reads; about
        40 % less CPU per prompt (docs/BENCHMARKS.md, gateway). A batch of one runs on the calling
        thread.
        """
        if self._encode_fast is not None:
            return self._encode_fast([text], add_special_tokens=add_special_tokens)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (special tokens skipped)."""
        return self.tokenizer.decode(ids)


def _token_text(tok: Any) -> str:
    if isinstance(tok, dict):
        return str(tok.get("content", ""))
    return "" if tok is None else str(tok)
