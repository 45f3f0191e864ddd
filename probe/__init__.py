"""probe: audit whether a transformer's attention weights explain its predictions."""

__version__ = "0.1.0"
