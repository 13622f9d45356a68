"""A chat request's prompt text: the chat template rendered as vLLM renders it, by the quickest way
that gives the same text.

`render_chat` applies the template as vLLM's /v1/chat/completions does (add_generation_prompt unless
the request says otherwise or continues the final message; tools; chat_template_kwargs; text parts
of list contents joined by newlines), through transformers' apply_chat_template. Two things make
that cheaper without changing a character of it:

- attribute reads in the jinja2 sandbox that transformers compiles the tokenizer's own templates
  into are answered once per (type, name) (`speed_up_template_reads`: the sandbox's own answers);
- a plain chat is rendered without apply_chat_template's per-call work (`FastChatRenderer`,
  `render_plain_chat`; below).

The model's own chat template rendered without transformers' per-call work, where that is exact:

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
from collections.abc import Callable
from typing import Any

from router.errors import KvgateError
from router.tokenize.messages import TokenizeError, flatten_content, request_chat_template

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


# What the jinja2 sandbox does on each attribute a template reads, in the jinja2 versions whose
# code was read for this (3.1): SandboxedEnvironment.getattr tries getattr(obj, name), falls back
# to obj[name], and asks is_safe_attribute of what getattr found; is_safe_attribute ignores the
# value and decides by the name and isinstance tests on the object, so by (type of obj, name).
_FAST_READS_JINJA_SERIES = "3.1."
# Distinct (type, attribute name) pairs remembered per template; a template reads a few dozen.
ATTRIBUTE_CHECKS_MAX = 4096
# Names getattr finds on a plain dict (its methods and object's); any other name it does not.
_DICT_ATTRIBUTES = frozenset(dir(dict))


class _MemoizedAttributeCheck:
    """A jinja2 sandbox's is_safe_attribute, remembered per (type of the object, attribute name).

    The sandbox asks on every attribute a template reads (`content.split`, `loop.index0`...), and
    answering costs a chain of isinstance tests each time. The answer is the sandbox's own,
    computed once per pair, never a different one."""

    def __init__(self, check: Callable[[Any, str, Any], bool]) -> None:
        self._check = check
        self._answers: dict[tuple[type, str], bool] = {}

    def __call__(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        answer = self._answers.get(key)
        if answer is None:
            answer = self._check(obj, attr, value)
            if len(self._answers) < ATTRIBUTE_CHECKS_MAX:
                self._answers[key] = answer
        return answer


class _SandboxGetattr:
    """A jinja2 sandbox's getattr, answering `message.role` on a plain dict without the failed
    attribute lookup (an exception) the sandbox goes through first.

    On an object of exactly type dict, getattr finds only the names in dir(dict), so for any other
    name the sandbox's answer is obj[name], or undefined where the key is missing: the same here.
    Everything else goes to the sandbox's own getattr."""

    def __init__(self, environment: Any) -> None:
        self._sandbox_getattr = environment.getattr
        self._undefined = environment.undefined

    def __call__(self, obj: Any, attribute: Any) -> Any:
        if type(obj) is dict and type(attribute) is str and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self._undefined(obj=obj, name=attribute)
        return self._sandbox_getattr(obj, attribute)


def _speed_up_sandbox_reads(environment: Any) -> bool:
    """Install the two shortcuts above on one jinja2 sandbox, where it is the one they were written
    for (same answers: tests/test_tokenize_template_memo.py)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not jinja2.__version__.startswith(_FAST_READS_JINJA_SERIES):
        return False
    if type(environment) is not ImmutableSandboxedEnvironment:
        return False
    if "is_safe_attribute" in vars(environment) or "getattr" in vars(environment):
        return False  # installed already (the environment is shared by every tokenizer using it)
    environment.is_safe_attribute = _MemoizedAttributeCheck(environment.is_safe_attribute)
    environment.getattr = _SandboxGetattr(environment)
    return True


def speed_up_template_reads(tokenizer: Any) -> bool:
    """Speed up attribute reads in the sandbox transformers compiles the tokenizer's own chat
    templates into (a request's own template is rendered in the template sandbox's process,
    untouched). Whether the tokenizer's templates render with the shortcuts."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return False
    templates = getattr(tokenizer, "chat_template", None)
    if isinstance(templates, str):
        templates = [templates]
    elif isinstance(templates, dict):
        templates = [t for t in templates.values() if isinstance(t, str)]
    else:
        return False
    sped_up = False
    for template in templates:
        try:
            environment = _compile_jinja_template(template).environment
        except Exception:  # a template jinja cannot compile fails its requests as before
            continue
        _speed_up_sandbox_reads(environment)
        sped_up = sped_up or isinstance(vars(environment).get("getattr"), _SandboxGetattr)
    return sped_up


def render_chat(tokenizer: Any, body: dict[str, Any]) -> str:
    """A chat request's prompt text: the tokenizer's chat template (or the request's own, which the
    gateway passes here only from its template sandbox) applied as vLLM applies it.

    transformers renders every template in jinja2's ImmutableSandboxedEnvironment: a template cannot
    reach Python internals nor change its inputs; what it costs is bounded by its caller."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise TokenizeError("`messages` must be a non-empty list")
    continue_final = bool(body.get("continue_final_message", False))
    add_generation_prompt = body.get("add_generation_prompt")
    if add_generation_prompt is None:
        add_generation_prompt = not continue_final
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise TokenizeError("`chat_template_kwargs` must be an object")
    template = request_chat_template(body)
    if template is not None:
        # vLLM merges chat_template_kwargs over its chat_template argument: the same here.
        kwargs = {**kwargs, "chat_template": template}
    try:
        return tokenizer.apply_chat_template(
            [flatten_content(message) for message in messages],
            tools=body.get("tools") or None,
            add_generation_prompt=bool(add_generation_prompt),
            continue_final_message=continue_final,
            tokenize=False,
            **kwargs,
        )
    except Exception as exc:  # jinja errors, template exceptions: the request's fault
        reason = str(exc) or type(exc).__name__
        raise TokenizeError(f"the chat template cannot render these messages: {reason}") from None


def render_plain_chat(fast_render: FastChatRenderer, body: dict[str, Any]) -> str | None:
    """The model's template applied by the fast renderer, or None where the request is not a
    plain chat it renders exactly (tools, a continued message, the request's own template...)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or body.get("tools"):
        return None
    if body.get("continue_final_message") or body.get("chat_template") is not None:
        return None
    variables = body.get("chat_template_kwargs") or {}
    if not isinstance(variables, dict) or "chat_template" in variables:
        return None
    add_generation_prompt = body.get("add_generation_prompt")
    try:
        flattened = [flatten_content(message) for message in messages]
    except TokenizeError:
        return None
    return fast_render.render(
        flattened, True if add_generation_prompt is None else bool(add_generation_prompt), variables
    )
