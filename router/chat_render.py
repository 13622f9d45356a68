"""The model's own chat template rendered without transformers' per-call work, where that is exact.

transformers' apply_chat_template spends most of a render outside the template: it copies and
normalises the messages (objects to dicts, None values dropped, reasoning fields aliased, every
value rebuilt as plain JSON data), looks the template up and merges the special tokens into its
variables. For a plain chat (every message a dict of strings, no reasoning field, no tools, no
continued final message, template variables that are plain scalars) all of that is the identity,
and what is left is the compiled template's render with a fixed set of variables.

`FastChatRenderer` renders exactly that set, by one of two engines:
- MiniJinja (the `minijinja` package, a compiled Rust engine; sandboxed by construction: a template
  sees only the values it is given and their safe methods), about 5x cheaper than jinja2 here;
- else the very jinja2 template transformers compiled (same object, same sandbox), which skips
  only the per-call work above.

Each engine is checked when the tokenizer loads: on a set of probe conversations (system or not,
one to many turns, assistant messages with reasoning markup, tool results, names, empty and
non-ASCII contents, special-token text inside contents, generation prompt on and off, template
variables such as `enable_thinking`) its text must equal apply_chat_template's, character for
character; an engine that differs or fails on any probe is not used. At run time a render the
fast path cannot do (a template error, a raise_exception) is redone by apply_chat_template, so errors
read as they always have. Requests outside the plain shape never take this path.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from router.errors import KvgateError

logger = logging.getLogger("kvgate.tokenize")

# Message keys transformers rewrites (aliases of the reasoning text): such messages go the slow path.
_REASONING_FIELDS = frozenset(("reasoning_content", "thinking", "reasoning"))
# Template variables a request may set through chat_template_kwargs on the fast path: plain scalars.
_SCALAR_TYPES = (str, bool, int, float)


# The engines tried, in order of preference.
ENGINES = ("minijinja", "jinja2")


class _TemplateRaised(KvgateError):
    """raise_exception() called by the template under MiniJinja."""


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _probe_conversations() -> list[tuple[list[dict[str, str]], bool, dict[str, Any]]]:
    """(messages, add_generation_prompt, template variables) the engines must render identically."""
    system = {"role": "system", "content": "You are a terse assistant.\nAnswer in one line."}
    turns = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  And  with   spaces?\n\n"},
        {"role": "assistant", "content": "<think>\nadding\n</think>\n\nStill 4."},
        {"role": "user", "content": "ünïcödé 中文 😀 e\u0301 tab\there"},
        {"role": "assistant", "content": "\n\n<think>short</think>Done.\n"},
        {"role": "user", "content": "text with <|im_end|> and <|endoftext|> inside, {{ braces }} {% raw %}"},
    ]
    tool_turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check."},
        {"role": "tool", "content": '{"temperature": 21, "unit": "C"}'},
        {"role": "tool", "content": "second result"},
        {"role": "user", "content": "Thanks."},
    ]
    probes: list[tuple[list[dict[str, str]], bool, dict[str, Any]]] = []
    for generation_prompt in (True, False):
        probes.append(([turns[0]], generation_prompt, {}))
        probes.append(([system, turns[0]], generation_prompt, {}))
        probes.append(([system, *turns], generation_prompt, {}))
        probes.append((turns[:4], generation_prompt, {}))
        probes.append(([system, *tool_turns], generation_prompt, {}))
        probes.append(([{"role": "user", "content": ""}], generation_prompt, {}))
        probes.append(([{"role": "user", "content": "hi", "name": "alice"}], generation_prompt, {}))
        probes.append(([system, *turns[:6]], generation_prompt, {"enable_thinking": False}))
        probes.append(([system, *turns[:6]], generation_prompt, {"enable_thinking": True}))
        probes.append((turns[:2], generation_prompt, {"custom_flag": 1, "note": "x"}))
    probes.append(([system, *turns[:5]], True, {}))  # ends on a user turn after reasoning markup
    probes.append(([*turns[:3], {"role": "assistant", "content": ""}], False, {}))
    return probes


class FastChatRenderer:
    """Renders plain chats with the tokenizer's own template, identically to apply_chat_template."""

    def __init__(self, tokenizer: Any, engines: tuple[str, ...] = ENGINES) -> None:
        self.engine = "off"  # "minijinja", "jinja2" or "off"
        self._tokenizer = tokenizer
        self._render_with: Any = None
        self._variables: dict[str, Any] = {}
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template, _plain_template_data

            template = tokenizer.get_chat_template(None, None)
            self._variables = _plain_template_data(dict(tokenizer.special_tokens_map))
            compiled = _compile_jinja_template(template)
            reserved = set(inspect.signature(tokenizer.apply_chat_template).parameters)
        except Exception:  # no template, another transformers: the slow path does everything
            logger.info("chat template fast path off: the tokenizer's template cannot be compiled here")
            return
        # Template variables transformers binds itself, or that would shadow the render's own.
        self._reserved = reserved | {"messages", "documents", "tools", "add_generation_prompt"}
        if not all(type(value) is str for value in self._variables.values()):
            return  # special tokens that are not plain strings: rare; keep the general path
        for engine in engines:
            render = self._minijinja(template) if engine == "minijinja" else compiled.render
            if render is not None and self._agrees(render):
                self.engine, self._render_with = engine, render
                return
        logger.info("chat template fast path off: no engine renders the probes as transformers does")

    def render(
        self, messages: list[Any], add_generation_prompt: bool, variables: dict[str, Any]
    ) -> str | None:
        """The prompt text, or None where this path does not apply (the caller renders it the slow way)."""
        if self._render_with is None or not self._plain(messages, variables):
            return None
        try:
            return self._render_with(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._variables,
                **variables,
            )
        except Exception:  # the template refused these messages: the slow path says why, as before
            return None

    def _plain(self, messages: list[Any], variables: dict[str, Any]) -> bool:
        for message in messages:
            if type(message) is not dict:
                return False
            for key, value in message.items():
                if type(key) is not str or type(value) is not str or key in _REASONING_FIELDS:
                    return False
        for key, value in variables.items():
            if type(key) is not str or type(value) not in _SCALAR_TYPES or key in self._reserved:
                return False
        return True

    def _minijinja(self, template: str) -> Any:
        try:
            import minijinja
        except ImportError:
            return None
        try:
            environment = minijinja.Environment()
            # jinja2's settings in transformers' environment, before the template is parsed; no
            # auto-escaping (MiniJinja picks it by the template's name: "chat" has none).
            environment.trim_blocks = True
            environment.lstrip_blocks = True
            environment.keep_trailing_newline = False
            environment.add_global("raise_exception", _raise_exception)
            environment.add_template("chat", template)
        except Exception:  # a template MiniJinja cannot parse
            return None

        def render(**variables: Any) -> str:
            return environment.render_template("chat", **variables)

        return render

    def _agrees(self, render: Any) -> bool:
        """Whether `render` gives apply_chat_template's text on every probe (and fails where it fails)."""
        for messages, generation_prompt, variables in _probe_conversations():
            try:
                expected = self._tokenizer.apply_chat_template(
                    [dict(message) for message in messages],
                    add_generation_prompt=generation_prompt,
                    tokenize=False,
                    **variables,
                )
            except Exception:
                expected = None
            try:
                got = render(
                    messages=[dict(message) for message in messages],
                    tools=None,
                    documents=None,
                    add_generation_prompt=generation_prompt,
                    **self._variables,
                    **variables,
                )
            except Exception:
                got = None
            if got != expected:
                return False
        return True
