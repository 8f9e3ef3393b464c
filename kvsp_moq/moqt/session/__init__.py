"""The sans-I/O session machinery every draft shares, in layers (each module imports only
those above it):

* `records`: what a session keeps of each request and data stream, and the protocols of
  the draft's data stream parsers and writers;
* `tokens`: the peer's authorization tokens, an object the session owns;
* `core`: the state a session keeps, the lookups of its requests, and the hooks a draft fills;
* `fetches`, `receiving`, `sending`: the peer's FETCHes, reading data streams and
  datagrams, writing objects;
* `base`: `SessionBase`, the lifecycle, and the answers both drafts give alike.

A draft's session (`d18.session.MoqtSession`, `d14.session.MoqtSession14`) builds on
`base.SessionBase`; requests and answers reach this package in their draft-18 form."""
