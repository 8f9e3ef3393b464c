"""kvsp-moq: the KV Cache Storage Protocol with a Media over QUIC Transport data plane."""

__version__ = "0.1.0"
