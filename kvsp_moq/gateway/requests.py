"""The OpenAI request bodies the gateway accepts, checked and reduced to what generation needs.

`POST /v1/completions`: "model", "prompt" (a string, one string in a list, token ids, or one
list of token ids), "max_tokens" (default 16, as OpenAI's), "temperature", "top_p", "seed",
"stop", "stream", "stream_options.include_usage", "n" (1 only), "user" (ignored).
`POST /v1/chat/completions`: "messages" instead of "prompt", and "max_completion_tokens" (or
the older "max_tokens"; default: as many as the instance allows).

What the gateway cannot honour is refused (400, "param" names it), never ignored: n > 1,
best_of > 1, logprobs, echo, suffix, tools, response_format other than text, logit_bias.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from kvsp_moq.gateway.errors import ApiError

__all__ = ["Ask", "Sampling", "parse_chat", "parse_completion"]

MAX_STOP = 4
MAX_STOP_CHARS = 256


@dataclass(frozen=True)
class Sampling:
    """temperature/top_p/seed as the instance's sampler: "greedy" when temperature is 0."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    def sampler(self) -> dict[str, Any]:
        """The `sampler` member of `POST {ii}generate`. A request without a seed draws one, so
        that two such requests differ as a client expects."""
        seed = self.seed if self.seed is not None else secrets.randbits(31)
        if self.temperature == 0:
            return {"method": "greedy", "seed": seed}
        return {"method": "top-p", "params": {"p": self.top_p, "temperature": self.temperature},
                "seed": seed}


@dataclass(frozen=True)
class Ask:
    """One request, checked: what to generate from and how."""

    chat: bool
    model: str
    prompt: str | None = None
    """Completion text; None with `prompt_tokens` or `messages`."""
    prompt_tokens: tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] = ()
    max_tokens: int | None = None
    """None: as many as the instance allows."""
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False


def _bad(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _body(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise _bad("the body must be a JSON object", "body", "invalid_type")
    return data


def _model(data: dict[str, Any]) -> str:
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required: one of the names GET /v1/models lists", "model",
                   "missing_required_parameter" if model is None else "invalid_type")
    return model


def _int(data: dict[str, Any], name: str, low: int, high: int = 1 << 31) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if type(value) is not int or not low <= value <= high:
        raise _bad(f"'{name}' must be an integer from {low} to {high}", name)
    return value


def _num(data: dict[str, Any], name: str, low: float, high: float, default: float) -> float:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise _bad(f"'{name}' must be a number from {low:g} to {high:g}", name)
    return float(value)


def _bool(data: dict[str, Any], name: str) -> bool:
    value = data.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"'{name}' must be a boolean", name, "invalid_type")
    return value


def _refuse_unsupported(data: dict[str, Any], chat: bool) -> None:
    n = data.get("n")
    if n is not None and n != 1:
        raise _bad("only n=1 is supported", "n")
    best_of = data.get("best_of")
    if best_of is not None and best_of != 1:
        raise _bad("only best_of=1 is supported", "best_of")
    for name in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions",
                 "logit_bias"):
        if data.get(name) not in (None, False):
            raise _bad(f"'{name}' is not supported by this gateway", name, "unsupported_parameter")
    fmt = data.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _bad("only the text response format is supported", "response_format",
                   "unsupported_parameter")


def _stop(data: dict[str, Any]) -> tuple[str, ...]:
    stop = data.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or len(stop) > MAX_STOP
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)):
        raise _bad(f"'stop' must be a string or up to {MAX_STOP} non-empty strings", "stop")
    return tuple(stop)


def _common(data: dict[str, Any], chat: bool) -> dict[str, Any]:
    _refuse_unsupported(data, chat)
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", "stream_options", "invalid_type")
    stream = _bool(data, "stream")
    return {
        "model": _model(data),
        "sampling": Sampling(_num(data, "temperature", 0.0, 2.0, 1.0),
                             _num(data, "top_p", 0.0, 1.0, 1.0) or 1.0,
                             _int(data, "seed", -(1 << 63), (1 << 63) - 1)),
        "stop": _stop(data),
        "stream": stream,
        "include_usage": bool(stream and options and _bool(options, "include_usage")),
    }


def _token_ids(value: list[Any]) -> tuple[int, ...] | None:
    """Token ids (ints, not bools, >= 0), checked in C: a prompt is hundreds of them, and this
    is on every request's path (the gateway's own time)."""
    if value and set(map(type, value)) == {int} and min(value) >= 0:
        return tuple(value)
    return None


def parse_completion(data: Any) -> Ask:
    data = _body(data)
    common = _common(data, chat=False)
    prompt = data.get("prompt")
    text: str | None = None
    tokens: tuple[int, ...] | None = None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list):
        tokens = _token_ids(prompt)
    if (text is None and tokens is None) or text == "":
        raise _bad("'prompt' must be a non-empty string or token ids (one prompt per request)",
                   "prompt")
    max_tokens = _int(data, "max_tokens", 1)
    return Ask(False, prompt=text, prompt_tokens=tokens,
               max_tokens=16 if max_tokens is None else max_tokens, **common)


ROLES = ("system", "developer", "user", "assistant", "tool")


def _message(m: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise _bad(f"each message needs a role ({', '.join(ROLES)})", where)
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise _bad("only text content parts are supported", where + ".content",
                           "unsupported_parameter")
            texts.append(part["text"])
        content = "".join(texts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise _bad("content must be a string or text parts", where + ".content", "invalid_type")
    return {"role": m["role"], "content": content}


def parse_chat(data: Any) -> Ask:
    data = _body(data)
    common = _common(data, chat=True)
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    checked = tuple(_message(m, i) for i, m in enumerate(messages))
    max_tokens = _int(data, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(data, "max_tokens", 1)
    return Ask(True, messages=checked, max_tokens=max_tokens, **common)
