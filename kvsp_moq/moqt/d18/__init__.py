"""MOQT draft-18 (ALPN "moqt-18"): control messages, data streams, the session."""
