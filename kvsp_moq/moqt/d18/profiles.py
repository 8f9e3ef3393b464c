"""Drafts 20 and 22 as differences from draft-18: one row per draft, one switch per
difference. They keep draft-18's streams, framing, vi64 integers and data plane, so the
draft-18 codec and session speak them with these switches (ALPN "moqt-20", "moqt-22").

Learnt from the peers that speak them (no draft text of either is published beside
ours); the KV mapping per draft is in README ("MOQT mapping").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["Profile", "PROFILES", "profile"]


@dataclass(frozen=True, slots=True)
class Profile:
    """What differs between draft-18 and its successors on the wire and in behaviour."""

    draft: int
    #: Parameter 0x21 is a LOCATION_FILTER (d20+) rather than a SUBSCRIPTION_FILTER, and
    #: FETCH carries its range in it (no Fetch Type, Start or End fields, no joining form);
    #: FETCH's and FETCH_OK's end is inclusive. FILL_PARAMETERS (0x23) replaces the
    #: joining FETCH: it opens a fetch stream under the SUBSCRIBE's (or REQUEST_UPDATE's)
    #: Request ID, with no FETCH_OK.
    location_filter: bool = False
    #: LOCATION_FILTER leads with a type (0x00-0x05) instead of a length (d22).
    location_filter_typed: bool = False
    #: TRACK_NAMESPACE_PREFIX (0x34) is the bare namespace, without a length (d22).
    bare_namespace_prefix: bool = False
    #: GOAWAY on the control stream ends with a Request ID (d18; gone in d20).
    goaway_request_id: bool = True
    #: PUBLISH_OK (REQUEST_OK to a PUBLISH) carries only EXPIRES; the subscriber's
    #: settings follow in a REQUEST_UPDATE (d20+).
    publish_ok_expires_only: bool = False
    #: Fetch streams may carry End of Timed-Out Range (0x20C) markers (d20+).
    timed_out_range: bool = False
    #: A FIN on a SUBSCRIBE_NAMESPACE / SUBSCRIBE_TRACKS request stream cancels it (d18).
    fin_cancels_discovery: bool = True
    #: REQUEST_ERROR codes DUPLICATE_SUBSCRIPTION and INVALID_JOINING_REQUEST_ID exist (d18).
    joining_error_codes: bool = True
    #: PUBLISH_DONE SUBSCRIPTION_ENDED (0x3) exists (d18); draft-20 removed it, and TRACK_ENDED
    #: (0x2) is sent in its place. (A relay forwarding PUBLISH_NAMESPACE downstream, which
    #: draft-22 stopped, needs no switch: our relay answers SUBSCRIBE_NAMESPACE with NAMESPACE
    #: in every draft and forwards PUBLISH_NAMESPACE only upstream.)
    subscription_ended: bool = True


D18 = Profile(18)
D20 = replace(
    D18,
    draft=20,
    location_filter=True,
    goaway_request_id=False,
    publish_ok_expires_only=True,
    timed_out_range=True,
    fin_cancels_discovery=False,
    joining_error_codes=False,
    subscription_ended=False,
)
D22 = replace(D20, draft=22, location_filter_typed=True, bare_namespace_prefix=True)

PROFILES: dict[int, Profile] = {18: D18, 20: D20, 22: D22}


def profile(draft: int) -> Profile:
    """The profile of a draft this codec speaks; NotImplementedError for any other."""
    try:
        return PROFILES[draft]
    except KeyError:
        raise NotImplementedError(f"no codec for draft-{draft}") from None
