"""What a relay is configured with (`RelaySettings`) and what it counts (`RelayStats`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvsp_moq.auth import Authenticator
from kvsp_moq.moqt.certs import ClientTls, SelfSignedCertificate
from kvsp_moq.moqt.quic import QuicSettings

__all__ = ["RelaySettings", "RelayStats"]

MiB = 1 << 20


@dataclass
class RelaySettings:
    """Everything a relay is configured with."""

    host: str = "127.0.0.1"
    port: int = 0
    #: a certificate to serve with; else `certfile`/`keyfile`; else one is generated
    certificate: SelfSignedCertificate | None = None
    certfile: str | None = None
    keyfile: str | None = None
    #: byte budget of the object cache
    cache_bytes: int = 256 * MiB
    #: moqt:// URL of the relay to ask for what no local publisher announced
    upstream: str | None = None
    #: token this relay presents in SETUP to its upstream relay
    upstream_token: str | None = None
    #: verify the upstream relay's certificate (with `upstream_cadata` / `upstream_cafile`)
    upstream_verify: bool = True
    upstream_cadata: bytes | None = None
    upstream_cafile: str | None = None
    #: how `kvsp relay` decided to check the upstream's certificate (names the options that
    #: fix a rejected one); None: from upstream_verify / upstream_cafile alone
    upstream_tls: ClientTls | None = None
    #: moqt:// URL at which others reach this relay (what `kvsp relay` prints; None: its
    #: listen address); its host goes in a generated certificate
    public_url: str | None = None
    #: without one the relay runs open
    authenticator: Authenticator | None = None
    quic: QuicSettings = field(default_factory=QuicSettings)
    #: per-subscriber queue limits; a subscriber beyond them is dropped (TOO_FAR_BEHIND)
    subscriber_queue_bytes: int = 32 * MiB
    subscriber_queue_objects: int = 4096
    #: longest RENDEZVOUS_TIMEOUT honoured, in milliseconds
    max_rendezvous_ms: int = 30_000
    #: how long an upstream request may take to be answered
    upstream_timeout: float = 10.0
    #: how long a subscriber gets to take its queued objects once its track has ended
    drain_timeout: float = 30.0
    #: how long a reader of a shared FETCH may take nothing while the others wait for it;
    #: then its stream is reset and the others go on
    fetch_stall_timeout: float = 10.0
    #: reconnect backoff towards the upstream relay
    upstream_retry_initial: float = 0.2
    upstream_retry_max: float = 5.0
    #: seconds between PINGs to every session (0: none). A peer that vanished without closing
    #: (killed, its machine lost) would otherwise keep its announcements and subscriptions
    #: until QUIC's idle timeout; one that leaves a PING unanswered for `probe_timeout`, and
    #: sends nothing meanwhile, is closed, which withdraws its namespaces and ends its tracks'
    #: subscriptions.
    probe_interval: float = 2.0
    probe_timeout: float = 6.0


@dataclass
class RelayStats:
    """Counters, for tests and metrics. "in" is from upstream, "out" towards subscribers."""

    objects_in: int = 0
    bytes_in: int = 0
    objects_out: int = 0
    bytes_out: int = 0
    subscribes: int = 0
    fetches: int = 0
    track_statuses: int = 0
    announces: int = 0
    publishes: int = 0
    #: FETCHes answered entirely from the cache, and those that needed upstream
    cache_hits: int = 0
    cache_misses: int = 0
    cache_objects_served: int = 0
    upstream_requests: int = 0
    #: cold FETCHes that read a response already coming from upstream for another
    fetches_shared: int = 0
    #: readers of a shared FETCH response dropped for stalling the others
    fetch_readers_dropped: int = 0
    upstream_subscribes: int = 0
    upstream_fetches: int = 0
    upstream_track_statuses: int = 0
    subscribers_dropped: int = 0
    #: the most octets ever queued for one subscriber
    subscriber_queue_peak_bytes: int = 0
    unauthorized: int = 0
    rendezvous_waits: int = 0
    rendezvous_timeouts: int = 0
    publishers_lost: int = 0
    #: REQUEST_UPDATEs from subscribers accepted and refused, and those sent upstream
    updates: int = 0
    updates_refused: int = 0
    upstream_updates: int = 0
    #: objects not forwarded because they outlived a subscriber's delivery timeout
    objects_expired: int = 0
    #: SUBSCRIBE_NAMESPACEs forwarded to the upstream relay
    upstream_namespace_subscribes: int = 0
    #: MOQT sessions clients opened
    sessions_accepted: int = 0
    #: sessions closed because a PING went unanswered
    peers_unresponsive: int = 0
    #: PINGs unanswered by peers that were still sending meanwhile (kept: a lossy path)
    pings_unanswered_kept: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

