"""The MOQT drafts this package speaks: each one's ALPN and session class.

A connection learns its draft from the negotiated ALPN (draft-18 section 3.1.2:
"moqt-" and the draft number; draft-14 always "moq-00" and a version in SETUP), then
runs that draft's sans-I/O session. Adding a draft is a row here and a package
beside `d18` and `d14`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from .session.base import SessionBase

#: MOQT drafts this package can speak, most preferred first.
SUPPORTED_DRAFTS: tuple[int, ...] = (18, 20, 22, 14)

_DRAFT14_ALPN = "moq-00"


def alpn_of(draft: int) -> str:
    """The ALPN of a supported draft: "moqt-18" (20, 22), or "moq-00" for draft-14."""
    if draft not in SUPPORTED_DRAFTS:
        raise ValueError(f"unsupported MOQT draft {draft!r}; supported: {SUPPORTED_DRAFTS}")
    return _DRAFT14_ALPN if draft == 14 else f"moqt-{draft}"


def draft_of_alpn(alpn: str | None, offered: Iterable[int] = SUPPORTED_DRAFTS) -> int | None:
    """The draft among `offered` whose ALPN is `alpn`, else None."""
    return {alpn_of(draft): draft for draft in offered}.get(alpn or "")


def check_drafts(drafts: Iterable[int]) -> tuple[int, ...]:
    """The drafts as a tuple, each supported and listed once, at least one."""
    result = tuple(drafts)
    if not result:
        raise ValueError("no MOQT draft to offer")
    if len(set(result)) != len(result):
        raise ValueError(f"a draft is listed twice in {result}")
    for draft in result:
        alpn_of(draft)
    return result


def session_class(draft: int) -> type[SessionBase]:
    """The sans-I/O session class that speaks `draft`."""
    alpn_of(draft)
    if draft == 14:
        from .d14.session import MoqtSession14

        return MoqtSession14
    from .d18.session import MoqtSession  # 20 and 22 too: d18.profiles

    return MoqtSession


def parse_drafts(text: str) -> tuple[int, ...]:
    """A command-line list of drafts ("18,20,22,14"), checked; argparse reports the error."""
    import argparse

    try:
        return check_drafts(int(part) for part in text.split(",") if part.strip())
    except ValueError as e:
        message = str(e) if "draft" in str(e) else f"not a list of draft numbers: {text!r}"
        raise argparse.ArgumentTypeError(message) from None
