"""Chat templates: OpenAI ``messages`` in, the prompt string out. The interface.

:class:`ChatTemplate` is what the pipeline holds; two renderers sit behind it:

* :class:`~frontend.preprocess.jinja.JinjaChatTemplate` runs the ``chat_template`` of a
  tokenizer_config.json the way HF ``transformers`` does, in a sandbox.
* :class:`~frontend.preprocess.deepseek_v4.DeepSeekV4ChatTemplate` is the built-in template
  used when the config has none (the DeepSeek-V4 tokenizer ships without one), in plain
  Python.

:meth:`ChatTemplate.from_tokenizer_config` picks one. Input is checked by
:mod:`frontend.preprocess.messages` before either renderer sees it, and every problem is
reported as its :class:`~frontend.preprocess.messages.TemplateError`. Nothing here does
I/O except reading the config in :meth:`ChatTemplate.from_tokenizer_config`.
"""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from frontend.preprocess.messages import TemplateError, validate_kwargs, validate_tools

__all__ = ["ChatTemplate"]


class ChatTemplate(abc.ABC):
    """Renders chat ``messages`` to the prompt string the tokenizer then encodes.

    The rendered string already holds BOS and every special token as text, so encode it
    with ``add_special_tokens=False``. Instances are immutable and thread-safe: render from
    worker threads freely.
    """

    @classmethod
    def from_tokenizer_config(
        cls, config: str | os.PathLike[str] | Mapping[str, Any], *, default_thinking: bool = False
    ) -> ChatTemplate:
        """Pick the renderer for a model.

        ``config`` is the parsed tokenizer_config.json, its path, or the directory holding it.
        A ``chat_template`` string is compiled with
        :class:`~frontend.preprocess.jinja.JinjaChatTemplate`; a list of ``{name, template}``
        uses the one named "default" (and "tool_use" when a request has tools, as HF does).
        From a path, a sibling ``chat_template.jinja`` (newer HF layout) is used when the
        config has none. With no template at all the built-in
        :class:`~frontend.preprocess.deepseek_v4.DeepSeekV4ChatTemplate`
        (``default_thinking`` passed on) is returned.

        Raises:
            OSError: the config cannot be read.
            TemplateError: the config is not JSON, or a template does not compile.
        """
        # The renderers subclass ChatTemplate, so this module cannot import them at its top;
        # only this factory needs them, once per model.
        from frontend.preprocess.deepseek_v4 import DeepSeekV4ChatTemplate
        from frontend.preprocess.jinja import JinjaChatTemplate

        sidecar: str | None = None
        if isinstance(config, Mapping):
            cfg: Mapping[str, Any] = config
        else:
            path = Path(config)
            if path.is_dir():
                path = path / "tokenizer_config.json"
            try:
                cfg = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise TemplateError(f"{path}: not valid JSON: {exc}") from exc
            jinja_file = path.with_name("chat_template.jinja")
            if jinja_file.is_file():
                sidecar = jinja_file.read_text(encoding="utf-8")
        source = cfg.get("chat_template") or sidecar
        if not source:
            return DeepSeekV4ChatTemplate(default_thinking=default_thinking)
        tokens = {
            name: _token_text(cfg.get(name))
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        return JinjaChatTemplate(source, special_tokens=tokens)

    def render(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render one request's conversation.

        ``add_generation_prompt`` appends the assistant turn opener after a final user
        turn. ``chat_template_kwargs`` are template switches (e.g. ``{"thinking": false}``).
        ``tools`` are OpenAI tool definitions (``{"type": "function", "function": {...}}``).

        Raises:
            TemplateError: invalid input, or the template failed while rendering.
        """
        return self._render(
            messages,
            add_generation_prompt=add_generation_prompt,
            kwargs=validate_kwargs(chat_template_kwargs),
            tools=validate_tools(tools),
        )

    def reads(self, name: str) -> bool:
        """The template reads the variable *name* (a ``chat_template_kwargs`` switch such
        as ``reasoning_effort``): a request setting it changes the prompt. False unless
        a renderer says so."""
        return False

    @abc.abstractmethod
    def _render(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
        tools: list[dict[str, Any]] | None,
    ) -> str:
        """The renderer's own work. ``kwargs`` and ``tools`` are already checked
        (:func:`~frontend.preprocess.messages.validate_kwargs`,
        :func:`~frontend.preprocess.messages.validate_tools`); ``messages`` is as the client
        sent it, for the renderer to pass through
        :func:`~frontend.preprocess.messages.validate_messages` with its own joiner.

        Raises:
            TemplateError: as :meth:`render`.
        """


def _token_text(token: Any) -> str | None:
    # tokenizer_config.json stores special tokens as a string or an AddedToken dict.
    if isinstance(token, Mapping):
        token = token.get("content")
    return token if isinstance(token, str) else None
