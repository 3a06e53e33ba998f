"""The admission core: pools of slots, tickets, the line (FIFO or fair between tenants), the
choice of upstream among those with room, tenants and their shares, and the hold clock behind
Retry-After. Standard library only: it knows nothing of HTTP, of the upstream client, of Redis or
of settings; callers pass numbers in and get tickets or refusals out.

`entry` is the one way in (`Gate`, held without asking whose it is; `Local`, the core's own)
and `policy` the line's numbers, which the shared line's scripts follow too. `admission`
(entering and the hand-off) builds on `pool` (the pools and where a ticket runs),
`ticket` (a request's claim), `line` (the FIFO line and the interface the fair one shares),
`fairline`, `waiter` (what both lines read of a ticket), `routing`, `tenants`, `quotas` (each
tenant's windows of requests and tokens), `deadlines` (a request's bound on waiting),
`sessions` (agent sessions' routing keys and flows), `preemption` (whom a long waiter may
preempt before its first byte) and `clock` (the hold average and every estimate from it).
`models` keeps one admission core per model when llama-server routers serve several.
"""
