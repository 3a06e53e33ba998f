"""slotgate: a slot-aware admission gate in front of llama.cpp's llama-server."""

__version__ = "0.1.0"
