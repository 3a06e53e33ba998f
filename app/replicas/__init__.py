"""Several slotgate replicas sharing one line through Redis/Valkey: the replica's gate
(`replica`), the shared line (`shared`), a request's ENTER and its reply (`arrival`) and its
place in the line (`ticket`), the replica's
heartbeat, fall-back and rejoin (`membership`), its gating on a core of its own while Redis is
away (`alone`), the tenants' quota windows for the fleet (`quotas`), the link to Redis
(`transport`) and the scripts (`lua`). It uses the admission core for policy; it must not know
HTTP requests or answers.
"""
