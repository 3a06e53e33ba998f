"""One request's path through the gate: the HTTP/1.1 protocol's bounds, the request, admission,
the relay of the upstream's answer (streamed, or assembled when a client asked for one body),
the answer's single writer and the access log line. The only package that speaks to clients.
"""
