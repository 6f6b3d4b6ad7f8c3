"""relay: the data-plane ingress/relay daemon of an E2B-compatible sandbox platform."""

__version__ = "0.1.0"
