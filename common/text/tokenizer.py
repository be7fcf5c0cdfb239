"""Tokenizer of a checkpoint folder: ``tokenizer.json`` through ``tokenizers``, chat template through jinja2.

Special tokens follow transformers 5: the post-processor of ``tokenizer.json`` adds BOS/EOS, and
``add_bos_token``/``add_eos_token`` in ``tokenizer_config.json`` do not override it. Only where
``tokenizer.json`` has no post-processor are those flags applied (as transformers 4's Llama
tokenizer did), so that a checkpoint trained with BOS still gets it. Chat
templates render in the same sandboxed jinja2 environment transformers uses (trim_blocks,
lstrip_blocks, loopcontrols, ``raise_exception``, ``strftime_now``, a non-escaping ``tojson``).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import processors

from kvferry.common.errors import ModelLoadError, RequestError

logger = logging.getLogger(__name__)

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path}: file not found; the checkpoint folder needs it for the tokenizer")
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON: {exc}") from exc


class Tokenizer:
    """Encode, decode and chat-format text for one checkpoint."""

    def __init__(self, backend: HfTokenizer, tokenizer_config: dict, generation_eos: list[int], source: str) -> None:
        self.backend = backend
        self.source = source
        self.special_tokens = {name: _token_text(tokenizer_config.get(name)) for name in _SPECIAL_NAMES}
        self.chat_template = self._pick_template(tokenizer_config.get("chat_template"))
        if self.chat_template is not None:
            try:
                _compile(self.chat_template)
            except jinja2.TemplateError as exc:
                raise ModelLoadError(f"{source}/tokenizer_config.json: chat_template does not compile: {exc}") from exc
        if backend.post_processor is None:
            add_bos, add_eos = tokenizer_config.get("add_bos_token"), tokenizer_config.get("add_eos_token")
            self._set_post_processor(bool(add_bos), bool(add_eos))
        self.bos_token_id = self._id_of(self.special_tokens["bos_token"])
        eos = [self._id_of(self.special_tokens["eos_token"])] + list(generation_eos)
        self.eos_token_ids = tuple(dict.fromkeys(i for i in eos if i is not None))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: file not found; only tokenizer.json (fast) tokenizers are supported")
        try:
            backend = HfTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise ModelLoadError(f"{path}: cannot load: {exc}") from exc
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json", required=False)
        template_path = model_dir / "chat_template.jinja"  # where transformers >= 4.43 may save it
        if "chat_template" not in tokenizer_config and template_path.is_file():
            tokenizer_config["chat_template"] = template_path.read_text()
        generation = _read_json(model_dir / "generation_config.json", required=False)
        eos = generation.get("eos_token_id")
        generation_eos = eos if isinstance(eos, list) else ([eos] if isinstance(eos, int) else [])
        return cls(backend, tokenizer_config, generation_eos, str(model_dir))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` to prompt text. Encode the result with ``add_special_tokens=False``
        (as transformers does): the template writes BOS itself."""
        if self.chat_template is None:
            raise RequestError(f"{self.source}: tokenizer_config.json has no chat_template; use a completion request")
        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        try:
            return _compile(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as exc:
            raise RequestError(f"chat template of {self.source} rejected the messages: {exc}") from exc

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def _pick_template(self, template: Any) -> str | None:
        # Some checkpoints store several named templates as [{"name": ..., "template": ...}].
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            return named.get("default")
        return template if isinstance(template, str) else None

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        bos, eos = self.special_tokens["bos_token"], self.special_tokens["eos_token"]
        add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
        special = [(t, self.backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        self.backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


class _GenerationTag(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask markers)
    and renders the body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    # jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
