"""What a request asks for: its endpoint, its cost in slots and KV-cache tokens, how long it is
expected to hold a slot, and the body to forward (rewritten to stream where slotgate assembles).
It reads request bodies only; it must not know the line, the upstreams or HTTP connections.
"""
