"""The model's tokenizer and chat template, read from its Hugging Face files.

``tokenizer.json`` is loaded with the ``tokenizers`` library (its post-processor adds
BOS where the model expects it); ``tokenizer_config.json`` supplies the special tokens
and the chat template, which ``chat_template.jinja`` overrides when present.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from aserve.errors import CorruptModelFileError, InvalidInputError, ModelFileNotFoundError
from aserve.model.hf_config import read_json


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelFileNotFoundError(f"tokenizer.json not found in {model_dir}")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise CorruptModelFileError(f"{path} cannot be parsed: {exc}") from exc
        config = read_json(model_dir / "tokenizer_config.json") if (model_dir / "tokenizer_config.json").is_file() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.special_ids = frozenset(
            token_id for token_id, added in self._tok.get_added_tokens_decoder().items() if added.special
        )
        template_file = model_dir / "chat_template.jinja"
        self.chat_template: str | None = (
            template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
        )
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {entry.get("name"): entry.get("template") for entry in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self._compiled_template: jinja2.Template | None = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render ``messages`` with the model's chat template (``extra``: more variables,
        such as ``tools`` or a template's own switches like ``enable_thinking``).

        Raises ``InvalidInputError`` when the model has no template or the template
        rejects the messages (for example roles in an order it does not allow).

        A ``developer`` message (OpenAI's newer name for the system prompt, which its
        clients send) is given to a template that never names that role as ``system``, as
        llama.cpp and vLLM's Responses API do: such a template would otherwise refuse it,
        or drop it without a word. Any other role goes to the template as it is (as in
        vLLM, where templates have roles of their own, such as Llama 3.1's ``ipython``).
        """
        if self.chat_template is None:
            raise InvalidInputError("this model has no chat template (tokenizer_config.json or chat_template.jinja)")
        if "developer" not in self.chat_template and any(m.get("role") == "developer" for m in messages):
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        if self._compiled_template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = _strftime_now
            env.filters["tojson"] = _tojson  # as transformers defines it: no HTML escaping
            self._compiled_template = env.from_string(self.chat_template)
        try:
            return self._compiled_template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except jinja2.TemplateError as exc:
            raise InvalidInputError(f"the chat template rejected the messages: {exc}", param="messages") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            # A template that assumes what the messages do not hold (a string content, a
            # key): the messages are what the caller can change. Found by the fuzzer.
            raise InvalidInputError(f"the chat template cannot render these messages ({type(exc).__name__}: {exc})",
                                    param="messages") from exc


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    import json

    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)
