"""The sans-I/O session machinery every draft shares, in layers (each module imports only
those above it):

* `records`: what a session keeps of each request and data stream, and the protocols of
  the draft's data stream parsers and writers;
* parts the session owns as objects: `tokens` (the peer's authorization tokens),
  `dialect` (the protocol of a draft's wire forms of data, one object per draft),
  `messages` (the protocol of a draft's control messages, the draft's sending part),
  `receiving` (the peer's data streams and datagrams, as events), `fetches` (the
  peer's FETCHes, joining ones held until their SUBSCRIBE is answered), `sending`
  (our data streams and datagrams); each asks of the session only the hooks its
  protocol (`ReceivingHooks`, `FetchHooks`, `SendingHooks`) names;
* `core`: the state a session keeps, its parts, the lookups of its requests, and the
  hooks a draft fills;
* `base`: `SessionBase`, the lifecycle, the answers both drafts give alike, and the
  public methods that check a request and hand it to a part (requests and other
  control messages to the draft's `messages.Messages`).

A draft's session (`d18.session.MoqtSession`, `d14.session.MoqtSession14`) builds on
`base.SessionBase`, hands it its `dialect.Dialect` and `messages.Messages`, and owns
the draft's own parts; requests and answers reach this
package in their draft-18 form."""
