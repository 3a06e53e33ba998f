"""One request's path through the gate: the HTTP/1.1 protocol's bounds, the request, which
headers cross, admission and the body bytes held meanwhile, the wait and the client leaving, the
relay of the upstream's answer (streamed, or assembled when a client asked for one body), the
answer's single writer, and what a request leaves behind (its metrics and access-log line). The
only package that speaks to clients; `Proxy` (relay.py) orchestrates the rest.
"""
