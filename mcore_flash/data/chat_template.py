"""A Hugging Face tokenizer's chat template, rendered as transformers' ``apply_chat_template``
renders it, with jinja2 alone (a dependency of torch; transformers stays a test-only
dependency and is the tests' oracle).

transformers renders the template in jinja2's immutable sandbox with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension and its ``{% generation %}`` block (kept
here as a plain block: it only marks assistant text), a ``tojson`` filter that does not
escape HTML, ``raise_exception`` and ``strftime_now``; the variables are ``messages``,
``add_generation_prompt`` and the tokenizer's named special tokens (``bos_token``,
``eos_token``, ...) as strings. It then encodes the text without adding special tokens.

The template is read where ``AutoTokenizer.from_pretrained`` reads it in a tokenizer
directory: ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template`` (a
string, or a list of named templates, of which ``default`` is used).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import Optional

# transformers' ``SPECIAL_TOKENS_ATTRIBUTES``: the special tokens a template sees by name
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer directory's chat template (Jinja source) and its named special tokens."""

    source: str
    special_tokens: dict

    @classmethod
    def from_directory(cls, directory: str) -> Optional["ChatTemplate"]:
        """The template of the tokenizer files in ``directory``; None where it has none."""
        config = _json(os.path.join(directory, "tokenizer_config.json"))
        source = _template_source(directory, config)
        if source is None:
            return None
        named = {**_json(os.path.join(directory, "special_tokens_map.json")), **config}
        special = {name: _token_text(named[name]) for name in SPECIAL_TOKENS if named.get(name)}
        return cls(source, special)

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The conversation ``messages`` (``[{"role": ..., "content": ...}]``) as text;
        ``add_generation_prompt``: end with the header of the assistant's reply.
        ``jinja2.TemplateError`` where the template raises (``raise_exception``)."""
        return (
            _environment()
            .from_string(self.source)
            .render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self.special_tokens,
            )
        )


def _json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _template_source(directory: str, config: dict) -> Optional[str]:
    path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry["name"]: entry["template"] for entry in template}
        if "default" not in named:
            raise ValueError(
                f"{directory}/tokenizer_config.json has chat templates {sorted(named)} but none "
                "named 'default'"
            )
        template = named["default"]
    return template


def _token_text(token) -> str:
    """A special token as ``tokenizer_config.json`` stores it: the text, or an ``AddedToken``
    record with its text under ``content``."""
    return token["content"] if isinstance(token, dict) else str(token)


def _environment():
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: its body, rendered as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return environment
