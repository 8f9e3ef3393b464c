"""Hypothesis strategies for MOQT values."""

from __future__ import annotations

from hypothesis import strategies as st

from kvsp_moq.moqt import wire
from kvsp_moq.moqt.d18 import messages as m
from kvsp_moq.moqt.varint import U64_MAX

u62 = st.integers(0, 2**62 - 1)
u64 = st.integers(0, U64_MAX)
field_bytes = st.binary(min_size=1, max_size=12)
namespaces = st.lists(field_bytes, min_size=0, max_size=5).map(tuple)
nonempty_namespaces = st.lists(field_bytes, min_size=1, max_size=5).map(tuple)
track_names = st.binary(max_size=16)
locations = st.builds(wire.Location, u62, u62)
reasons = st.text(max_size=40)

tokens = st.one_of(
    st.builds(wire.AuthToken.use_value, st.binary(max_size=20), u62),
    st.builds(wire.AuthToken.register, u62, st.binary(max_size=20), u62),
    st.builds(wire.AuthToken.use_alias, u62),
    st.builds(wire.AuthToken.delete, u62),
)


@st.composite
def subscription_filters(draw) -> wire.SubscriptionFilter:
    kind = draw(st.sampled_from(list(wire.FilterType)))
    if kind == wire.FilterType.ABSOLUTE_START:
        return wire.SubscriptionFilter.absolute_start(draw(u62), draw(u62))
    if kind == wire.FilterType.ABSOLUTE_RANGE:
        group = draw(st.integers(0, 2**40))
        return wire.SubscriptionFilter.absolute_range(group, draw(u62), group + draw(st.integers(0, 2**20)))
    return wire.SubscriptionFilter(kind)


_VALUES = {
    "authorization_tokens": st.lists(tokens, min_size=1, max_size=3).map(tuple),
    "object_delivery_timeout": u62,
    "rendezvous_timeout": u62,
    "subgroup_delivery_timeout": u62,
    "expires": u62,
    "largest_object": locations,
    "fill_timeout": u62,
    "forward": st.booleans(),
    "subscriber_priority": st.integers(0, 255),
    "subscription_filter": subscription_filters(),
    "group_order": st.sampled_from(list(wire.GroupOrder)),
    "new_group_request": u62,
    "track_namespace_prefix": namespaces,
}


@st.composite
def parameters(draw, allowed: frozenset[int]) -> m.Parameters:
    names = [name for ptype, (name, _) in m._PARAMETER_FIELDS.items() if ptype in allowed]
    chosen = draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names))) if names else []
    return m.Parameters(**{name: draw(_VALUES[name]) for name in chosen})


def _property(ptype: int):
    if ptype & 1:
        return st.binary(max_size=24).map(lambda v: (ptype, v))
    return u62.map(lambda v: (ptype, v))


@st.composite
def properties(draw, max_size: int = 4) -> wire.Properties:
    types = sorted(draw(st.lists(st.integers(0x40, 0x3FFF), max_size=max_size)))
    return tuple(draw(_property(t)) for t in types)


def messages() -> st.SearchStrategy[m.Message]:
    return st.one_of(
        st.builds(
            m.Setup,
            path=st.none() | st.text(max_size=20),
            authority=st.none() | st.text(max_size=20),
            max_auth_token_cache_size=st.none() | u62,
            authorization_tokens=st.lists(
                st.one_of(
                    st.builds(wire.AuthToken.use_value, st.binary(max_size=8)),
                    st.builds(wire.AuthToken.register, u62, st.binary(max_size=8)),
                ),
                max_size=2,
            ).map(tuple),
            implementation=st.none() | st.text(max_size=20),
            unknown_options=st.lists(st.integers(0x9D, 0x400), unique=True, max_size=3).map(
                lambda types: tuple((t, b"v" if t & 1 else 7) for t in sorted(types))
            ),
        ),
        st.builds(m.Goaway, st.text(max_size=30), u62, st.none() | u62),
        st.builds(m.Subscribe, u62, namespaces, track_names, parameters(m._SCOPE_SUBSCRIBE)),
        st.builds(m.SubscribeOk, u62, parameters(m._SCOPE_SUBSCRIBE_OK), properties()),
        st.builds(m.Publish, u62, namespaces, track_names, u62, parameters(m._SCOPE_PUBLISH), properties()),
        st.builds(m.PublishDone, u62, u62, reasons),
        st.builds(
            m.Fetch,
            u62,
            st.just(wire.FetchType.STANDALONE),
            namespaces,
            track_names,
            locations,
            locations,
            parameters=parameters(m._SCOPE_FETCH),
        ),
        st.builds(
            m.Fetch,
            u62,
            st.sampled_from([wire.FetchType.RELATIVE_JOINING, wire.FetchType.ABSOLUTE_JOINING]),
            joining_request_id=u62,
            joining_start=u62,
            parameters=parameters(m._SCOPE_FETCH),
        ),
        st.builds(m.FetchOk, st.booleans(), locations, st.just(m.Parameters()), properties()),
        st.builds(m.TrackStatus, u62, namespaces, track_names, parameters(m._SCOPE_TRACK_STATUS)),
        st.builds(m.PublishNamespace, u62, nonempty_namespaces, parameters(m._SCOPE_NAMESPACE_REQUEST)),
        st.builds(m.SubscribeNamespace, u62, namespaces, parameters(m._SCOPE_NAMESPACE_REQUEST)),
        st.builds(m.SubscribeTracks, u62, namespaces, parameters(m._SCOPE_SUBSCRIBE_TRACKS)),
        st.builds(m.Namespace, namespaces),
        st.builds(m.NamespaceDone, namespaces),
        st.builds(m.PublishBlocked, namespaces, track_names),
        st.builds(m.RequestUpdate, u62, parameters(m._SCOPE_REQUEST_UPDATE)),
        st.builds(m.RequestOk, parameters(m._SCOPE_REQUEST_OK), properties()),
        st.builds(m.RequestErrorMessage, u62.filter(lambda c: c != 0x34), u62, reasons),
        st.builds(
            m.RequestErrorMessage,
            st.just(0x34),
            u62,
            reasons,
            st.builds(m.Redirect, st.text(max_size=20), namespaces, track_names),
        ),
    )
