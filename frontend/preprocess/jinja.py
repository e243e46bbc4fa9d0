"""Jinja chat templates from tokenizer_config.json, rendered the way HF ``transformers`` does.

:class:`JinjaChatTemplate` uses the same jinja environment options, globals
(``raise_exception``, ``strftime_now``) and ``tojson`` filter as HF, and accepts HF's
``{% generation %}`` tag, so a model's template renders here as it does there. It runs
inside jinja2's *immutable sandbox*: a template is untrusted input and must not reach
Python internals or mutate the request. A template is compiled once, when the model is
loaded, and rendered per request.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2.exceptions
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from frontend.preprocess.messages import TemplateError, validate_messages
from frontend.preprocess.template import ChatTemplate

__all__ = ["JinjaChatTemplate"]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's filter: plain json.dumps, no HTML escaping (jinja's own tojson escapes <, >, &).
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body, so templates written for
    HF's assistant-mask tracking compile here too (we never need the mask)."""

    # Immutable on purpose; jinja declares a set but only iterates it.
    tags = frozenset({"generation"})  # type: ignore[assignment]

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


_RESERVED_VARS = frozenset({"messages", "add_generation_prompt", "tools"})


class JinjaChatTemplate(ChatTemplate):
    """A jinja chat template compiled once, rendered per request in a sandbox.

    Template variables: ``messages`` (validated; list ``content`` flattened to a string
    with text parts joined by newlines, as vLLM does for string-content templates),
    ``add_generation_prompt``, ``tools``, the special tokens given (``bos_token``,
    ``eos_token``, ...), then ``chat_template_kwargs`` spread in (they may override special
    tokens, not the three request variables).
    """

    def __init__(self, source: Any, *, special_tokens: Mapping[str, str | None] | None = None):
        """``source`` is a template string or HF's list of ``{name, template}``.

        Raises:
            TemplateError: the template does not compile, or the list has no "default".
        """
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        named = _named_templates(source)
        if "default" not in named:
            raise TemplateError("chat_template list has no template named 'default'")
        try:
            self._templates = {name: env.from_string(text) for name, text in named.items()}
            # The variables the templates read that nothing here defines: their switches.
            self._reads = frozenset().union(
                *(jinja2.meta.find_undeclared_variables(env.parse(text)) for text in named.values())
            )
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"chat template does not compile: {exc}") from exc
        self._special = {k: v for k, v in (special_tokens or {}).items() if v is not None}

    def reads(self, name: str) -> bool:
        return name in self._reads

    def _render(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
        tools: list[dict[str, Any]] | None,
    ) -> str:
        checked = validate_messages(messages, joiner="\n")
        clash = _RESERVED_VARS.intersection(kwargs)
        if clash:
            raise TemplateError(f"chat_template_kwargs may not set {sorted(clash)[0]!r}")
        template = self._templates["default"]
        if tools is not None and "tool_use" in self._templates:
            template = self._templates["tool_use"]
        variables = {
            **self._special,
            **kwargs,
            "messages": checked,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
        }
        try:
            return template.render(variables)
        except jinja2.exceptions.TemplateError as exc:  # includes SecurityError, raise_exception
            raise TemplateError(f"chat template error: {exc}") from exc
        except Exception as exc:  # a template bug (e.g. None + str) is still this request's 400
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc


def _named_templates(source: Any) -> dict[str, str]:
    if isinstance(source, str):
        return {"default": source}
    if isinstance(source, list):
        named = {}
        for item in source:
            if not (
                isinstance(item, Mapping)
                and isinstance(item.get("name"), str)
                and isinstance(item.get("template"), str)
            ):
                raise TemplateError("chat_template list items must be {name, template} strings")
            named[item["name"]] = item["template"]
        return named
    raise TemplateError("chat_template must be a string or a list of {name, template}")
