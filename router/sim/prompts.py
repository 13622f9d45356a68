"""Prompt tokenization of the simulated engine, done as vLLM's OpenAI server does it, and cached.

- Completions: the prompt string is encoded with the tokenizer's special tokens (vLLM's default),
  or taken as given when it is a list of token ids.
- Chat: the model's chat template renders the messages (add_generation_prompt, continue_final_message,
  tools and chat_template_kwargs passed through), then the text is encoded without special tokens.
  A message whose content is a list of text parts is joined with newlines first, as vLLM does.
Tokenizing is the simulator's main CPU cost, so results are kept in an LRU keyed by the exact input,
and rendered chat text is encoded piece by piece between the tokenizer's added tokens (<|im_start|>,
<|im_end|>, ...), each piece cached: the tokenizer splits on added tokens before anything else, so
the pieces encode independently, and a new turn only costs its own new text. That equivalence is
checked on a sample conversation at start-up; where it does not hold, whole texts are encoded.
"""

from __future__ import annotations

import logging
import os
import re
from collections import OrderedDict
from typing import Any

import msgspec
import numpy as np

from router.config import builtin_tokenizer_dir
from router.errors import KvgateError

log = logging.getLogger("kvgate.sim")


class PromptError(KvgateError, ValueError):
    """A request whose prompt or messages cannot be tokenized; the message says why."""


def resolve_tokenizer_dir(value: str) -> str:
    """A tokenizer directory from --tokenizer: a path, or builtin:NAME (e.g. builtin:qwen3)."""
    if value.startswith("builtin:"):
        return builtin_tokenizer_dir(value.removeprefix("builtin:"))
    path = os.path.expanduser(value)
    if not os.path.isdir(path):
        raise ValueError(
            f"--tokenizer {value!r} is not a directory; give a local tokenizer directory or builtin:qwen3"
        )
    return path


class PromptTokenizer:
    def __init__(self, tokenizer_dir: str, cache_size: int = 8192):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.tokenizer = _load_tokenizer(tokenizer_dir)
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._cache_size = cache_size
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._added_token_ids, self._added_token_pattern = self._added_tokens()
        self.output_vocabulary = self._word_tokens()
        self._output_text = {int(i): self.tokenizer.decode([int(i)]) for i in self.output_vocabulary}

    def completion_prompt(self, prompt: Any, add_special_tokens: bool = True) -> np.ndarray:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            key = b"p" + bytes([add_special_tokens]) + prompt.encode()
            return self._cached(
                key, lambda: self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
            )
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = len(self.tokenizer)
            if any(t < 0 or t >= vocab for t in prompt):
                raise PromptError(f"prompt token ids must lie in [0, {vocab})")
            return np.asarray(prompt, dtype=np.uint32)
        raise PromptError("`prompt` must be a string, a list of token ids, or a batch of exactly one of them")

    def chat_prompt(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Any = None,
        chat_template_kwargs: dict | None = None,
        add_special_tokens: bool = False,
    ) -> np.ndarray:
        if not isinstance(messages, list) or not messages:
            raise PromptError("`messages` must be a non-empty list of {role, content} objects")
        key = b"c" + msgspec.json.encode(
            [
                messages,
                add_generation_prompt,
                continue_final_message,
                tools,
                chat_template_kwargs,
                add_special_tokens,
            ]
        )

        def render() -> list[int]:
            conversation = [_flatten_message(m, i) for i, m in enumerate(messages)]
            try:
                text = self.tokenizer.apply_chat_template(
                    conversation,
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    tokenize=False,
                    **(chat_template_kwargs or {}),
                )
            except Exception as exc:  # the template itself raises on bad conversations
                raise PromptError(f"the chat template refused these messages: {exc}") from None
            if add_special_tokens or self._added_token_pattern is None:
                return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
            return self._encode_by_pieces(text)

        return self._cached(key, render)

    def token_strings(self, tokens: np.ndarray) -> list[str]:
        return self.tokenizer.convert_ids_to_tokens(tokens.tolist())

    def output_text(self, token: int) -> str:
        """The text of one generated token (always one of `output_vocabulary`)."""
        return self._output_text[token]

    def _cached(self, key: bytes, compute) -> np.ndarray:
        tokens = self._cache.get(key)
        if tokens is not None:
            self._cache.move_to_end(key)
            return tokens
        tokens = np.asarray(compute(), dtype=np.uint32)
        tokens.flags.writeable = False
        self._cache[key] = tokens
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return tokens

    def _encode_by_pieces(self, text: str) -> list[int]:
        assert self._added_token_pattern is not None
        ids: list[int] = []
        for index, piece in enumerate(self._added_token_pattern.split(text)):
            if index % 2:  # the split keeps the added tokens at odd positions
                ids.append(self._added_token_ids[piece])
            elif piece:
                cached = self._pieces.get(piece)
                if cached is None:
                    cached = self.tokenizer.encode(piece, add_special_tokens=False)
                    self._pieces[piece] = cached
                    if len(self._pieces) > 4 * self._cache_size:
                        self._pieces.popitem(last=False)
                else:
                    self._pieces.move_to_end(piece)
                ids.extend(cached)
        return ids

    def _added_tokens(self) -> tuple[dict[str, int], re.Pattern[str] | None]:
        """The added tokens and a pattern splitting text on them, or None where piecewise encoding
        would differ from encoding the whole text (whitespace-stripping or normalized added tokens)."""
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        ids = {token.content: token_id for token_id, token in decoder.items()}
        if not ids or any(t.lstrip or t.rstrip or t.normalized for t in decoder.values()):
            return ids, None
        pattern = re.compile("(" + "|".join(re.escape(c) for c in sorted(ids, key=len, reverse=True)) + ")")
        sample = [
            {"role": "system", "content": "You are a helpful assistant.\n  Indented; café, 東京, emoji 🙂."},
            {"role": "user", "content": "Hello<think>hmm</think> there   \n\n"},
            {"role": "assistant", "content": " Sure thing."},
            {"role": "user", "content": "again"},
        ]
        try:
            text = self.tokenizer.apply_chat_template(sample, tokenize=False, add_generation_prompt=True)
        except Exception:  # no chat template: piecewise encoding is still exact for plain text
            text = "".join(m["content"] for m in sample)
        self._added_token_ids, self._added_token_pattern = ids, pattern
        if self._encode_by_pieces(text) != self.tokenizer.encode(text, add_special_tokens=False):
            log.warning("this tokenizer does not encode chat text piecewise; encoding whole prompts")
            self._pieces.clear()
            return ids, None
        return ids, pattern

    def _word_tokens(self) -> np.ndarray:
        """Ids of tokens that are a space and a short lowercase word: output text that reads as words
        and decodes token by token exactly as the whole (no multi-byte pieces)."""
        vocabulary = self.tokenizer.get_vocab()
        words = sorted(i for piece, i in vocabulary.items() if re.fullmatch("Ġ[a-z]{3,8}", piece))
        if not words:  # a tokenizer without byte-level pieces: fall back to plain ids
            words = list(range(min(1000, len(vocabulary))))
        return np.asarray(words[:4096], dtype=np.uint32)


def _load_tokenizer(tokenizer_dir: str):
    """The tokenizer of `tokenizer_dir`, as AutoTokenizer would load it but cheaper where possible.

    With a tokenizer.json, transformers' tokenizers-backed base class reads the same file and chat
    template, without the import chain of AutoTokenizer, which pulls in torch (about 200 MB more per
    simulated engine, and seconds of start-up). Parity with AutoTokenizer is a test
    (tests/test_sim_prompts.py).
    """
    if os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:  # transformers 4.x names it PreTrainedTokenizerFast
            from transformers import PreTrainedTokenizerFast as TokenizersBackend
        return TokenizersBackend.from_pretrained(tokenizer_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _flatten_message(message: Any, index: int) -> dict:
    if not isinstance(message, dict) or "role" not in message:
        raise PromptError(f"messages[{index}] must be an object with a `role`")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") not in ("text", "input_text", "output_text")
                or not isinstance(part.get("text"), str)
            ):
                raise PromptError(
                    f"messages[{index}].content: only text parts are supported by the simulator"
                )
            texts.append(part["text"])
        message = {**message, "content": "\n".join(texts)}
    return message
