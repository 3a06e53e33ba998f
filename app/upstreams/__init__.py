"""The llama-servers behind the gate: slotgate's own HTTP/1.1 client and its connection reuse,
how one llama-server is reached (`server`), what its `/props` says (`props`), its readiness
(`upstream`), a router's models (`router`), the set of upstreams (static or from DNS) and
their CORS. It must not know how requests wait for a slot or how answers reach clients.
"""
