"""OpenAI's response objects: completions and chat completions, whole or as SSE chunks.

A stream is `data: {chunk}\n\n` events and a final `data: [DONE]\n\n`. Completions put text in
`choices[0].text`, chat in `choices[0].delta.content` (the first chunk carries the role). The
last chunk with a choice carries `finish_reason` ("stop": an end-of-sequence token or a stop
string; "length": max_tokens). `usage` (prompt, completion and total tokens, and the prompt
tokens loaded rather than computed as `prompt_tokens_details.cached_tokens`) is in the whole
response, and in a last chunk with no choices when the client asked for it
(`stream_options.include_usage`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Shape", "sse", "usage", "DONE"]

DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


@dataclass(frozen=True)
class Shape:
    """The objects of one response: its id, model and kind."""

    chat: bool
    id: str
    model: str
    created: int = 0

    @classmethod
    def new(cls, chat: bool, request_id: str, model: str) -> "Shape":
        prefix = "chatcmpl-" if chat else "cmpl-"
        return cls(chat, prefix + request_id.replace("-", ""), model, int(time.time()))

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": kind + (".chunk" if chunk and self.chat else ""),
                "created": self.created, "model": self.model}

    def chunk(self, text: str | None, finish: str | None = None, *,
              first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, use: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": use}

    def whole(self, text: str, finish: str, use: dict[str, Any]) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                              "content": text},
                                      "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head(False), "choices": [choice], "usage": use}
