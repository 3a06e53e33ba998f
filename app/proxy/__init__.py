"""One request's path through the gate; the only package that speaks to clients. `Proxy`
(`relay`) orchestrates it; each other module owns one part: `protocol` (the HTTP/1.1
connection's bounds), `request` (one request as taken in), `access` (API keys and tenants),
`headers` (which headers cross), `body_bytes` (the bytes of bodies not yet admitted), `watch`
(cancellation: the client leaving, the drain running out), `modes` (the three ways an answer
goes back) with `assembly` (one JSON body from a stream), `answer` (the answer's single
writer), `refusals` (a refusal as the bytes of an HTTP answer), `quota` (a tenant's quotas: the
check, the rate-limit headers, the tokens an answer used) and `accounting` (what a request
leaves behind: its quota charge, metrics and access-log line). It enters admission through one
`Gate` and must not know FastAPI, nor whether the line is this process's or shared through Redis.
"""
