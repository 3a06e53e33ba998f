"""What an operator looks at: the status page (`page`: `GET /status`, its HTML, CSS and
JavaScript as package data in `web/`), the admission snapshot as server-sent events (`events`:
`GET /admission/events`), and the figures of the last minutes both show (`recent`). Everything
here is computed when someone asks, never per request. It reads the gate, the proxy and the
metrics, and must not change them.
"""
