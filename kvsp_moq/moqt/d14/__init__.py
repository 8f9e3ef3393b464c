"""MOQT draft-14 (ALPN "moq-00"), the fallback for older peers: control messages, data
streams, the session; its items are converted to and from their draft-18 forms."""
