"""Several slotgate replicas sharing one line through Redis/Valkey: the replica's gate, the
shared line's transport and its Lua scripts. It uses the admission core for policy; it must not
know HTTP requests or answers.
"""
