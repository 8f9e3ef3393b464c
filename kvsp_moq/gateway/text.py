"""Text to token ids and back, as the model does: its tokenizer.json (`tokenizers`), its chat
template, its end-of-sequence ids, incremental detokenization and stop strings.

The chat template is the model's own when tokenizer_config.json has a "chat_template" (rendered
with jinja2 in a sandbox, as transformers renders it: `messages`, `add_generation_prompt`,
`bos_token`, `eos_token`); a model without one gets `DEFAULT_TEMPLATE`, one line per message,
`role: content`, then `assistant:` for the answer. A rendered template carries its own special
tokens, so it is tokenized without adding them again; a completion prompt gets them as the
tokenizer's post-processor adds them (BOS for most models), as vLLM does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = ["DEFAULT_TEMPLATE", "Detokenizer", "ModelText", "StopScan"]

#: The chat template of a model that has none (documented in README "Gateway").
DEFAULT_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}assistant:{% endif %}")
#: Prompt tokens decoded before the first new one, so that a token's leading space or a
#: multi-byte character that spans tokens comes out as the whole text would have it.
CONTEXT_TOKENS = 5


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ModelText:
    """The tokenizer side of one model directory."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer

        self.directory = Path(directory)
        self.tokenizer = Tokenizer.from_file(str(self.directory / "tokenizer.json"))
        config = _read_json(self.directory / "tokenizer_config.json")
        self.bos_token = _token_text(config.get("bos_token")) or ""
        self.eos_token = _token_text(config.get("eos_token")) or ""
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        own = template if isinstance(template, str) and template else None
        self.own_template = own is not None
        self._template = self._compile(own or DEFAULT_TEMPLATE)
        self.eos_ids = frozenset(self._eos_ids())

    def _eos_ids(self) -> Iterable[int]:
        for name in ("generation_config.json", "config.json"):
            value = _read_json(self.directory / name).get("eos_token_id")
            ids = value if isinstance(value, list) else [value]
            found = [i for i in ids if type(i) is int]
            if found:
                return found
        if self.eos_token:
            tid = self.tokenizer.token_to_id(self.eos_token)
            if tid is not None:
                return [tid]
        return []

    @staticmethod
    def _compile(source: str) -> Any:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False,
                                                                  indent=indent)
        return env.from_string(source)

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        """The prompt text of a conversation, ready for the assistant's answer; ValueError when
        the model's template refuses it (e.g. roles that do not alternate)."""
        from jinja2.exceptions import TemplateError

        try:
            return str(self._template.render(messages=list(messages), add_generation_prompt=True,
                                             bos_token=self.bos_token, eos_token=self.eos_token))
        except TemplateError as e:
            raise ValueError(f"the chat template refused the messages: {e}") from None

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def chat_tokens(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        text = self.render_chat(messages)
        # The model's own template writes its special tokens; the default one writes none.
        return self.encode(text, special=not self.own_template)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def detokenizer(self, prompt: Sequence[int]) -> "Detokenizer":
        return Detokenizer(self, prompt)


class Detokenizer:
    """New text as tokens arrive, without decoding the whole output each time: the text of the
    tokens after a moving offset, less the text of those already shown. Text that ends in an
    incomplete character (U+FFFD) waits for the next token."""

    def __init__(self, text: ModelText, prompt: Sequence[int]) -> None:
        self.text = text
        self.ids = list(prompt[-CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self.text.decode(self.ids[self.prefix:self.read])
        after = self.text.decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]


class StopScan:
    """Stop strings over streamed text: what may be sent now, and whether a stop string ended
    the text. Text that could be the start of a stop string is held back until it is not."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, delta: str) -> str:
        """Add text; the part that may be sent now (cut before a stop string)."""
        if self.stopped:
            return ""
        self.text += delta
        if not self.stops:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        longest = max(len(s) for s in self.stops)
        start = max(0, self.sent - longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            self.stopped = True
            out, self.sent = self.text[self.sent:end], end
            return out
        safe = len(self.text)
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    safe = min(safe, len(self.text) - k)
                    break
        safe = max(safe, self.sent)
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def flush(self) -> str:
        """What is held back, at the end of the output."""
        if self.stopped:
            return ""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
