"""What the tests of the request's intake and of the KV budget both read: how much a request may
generate, as llama-server reads it."""

from __future__ import annotations

from typing import Any

# A request's output limit as llama-server reads it (llama.cpp tools/server, 11434 build):
# server-schema.cpp's field n_predict takes the first present and non-null of n_predict,
# max_completion_tokens, max_tokens; -1 there means "the server's own -n" (server-context.cpp
# launch_slot_with_task), which is -1, no limit, unless the server was started with -n. The
# Responses converter (server-chat.cpp) turns max_output_tokens into max_tokens, replacing one
# the body had; the Anthropic one keeps max_tokens alone and puts 4096 in when it is missing.
# Rows: route, body, the server's -n (None = unset), the tokens it may generate (None = no
# limit: up to the end of its slot's context).
OUTPUT_LIMITS: list[tuple[str, dict[str, Any], int | None, int | None]] = [
    ("/v1/chat/completions", {"n_predict": -1, "max_tokens": 3}, None, None),
    ("/v1/chat/completions", {"n_predict": -1, "max_tokens": 3}, 50, 50),
    ("/v1/chat/completions", {"max_completion_tokens": 5, "max_tokens": 9}, None, 5),
    ("/v1/chat/completions", {"n_predict": 7, "max_completion_tokens": 5}, None, 7),
    ("/v1/chat/completions", {"n_predict": -1, "max_completion_tokens": 5}, None, None),
    ("/v1/chat/completions", {"n_predict": None, "max_tokens": 3}, None, 3),
    ("/v1/chat/completions", {"max_tokens": -1}, None, None),
    ("/v1/chat/completions", {"max_tokens": -1}, 40, 40),
    ("/v1/chat/completions", {"max_tokens": 0}, None, 0),
    ("/v1/chat/completions", {}, None, None),
    ("/v1/chat/completions", {}, 40, 40),
    ("/chat/completions", {"max_completion_tokens": 5, "max_tokens": 9}, None, 5),
    ("/completion", {"prompt": "a", "n_predict": -1, "max_tokens": 3}, None, None),
    ("/completion", {"prompt": "a", "max_completion_tokens": 5, "max_tokens": 9}, None, 5),
    ("/v1/completions", {"prompt": "a", "n_predict": -1, "max_tokens": 3}, None, None),
    ("/completions", {"prompt": "a", "max_completion_tokens": 5, "max_tokens": 9}, None, 5),
    ("/infill", {"input_prefix": "a", "n_predict": -1, "max_tokens": 3}, None, None),
    ("/infill", {"input_prefix": "a", "max_completion_tokens": 5, "max_tokens": 9}, None, 5),
    ("/v1/responses", {"input": "a", "max_output_tokens": 4, "max_tokens": 9}, None, 4),
    ("/v1/responses", {"input": "a", "max_output_tokens": 4, "max_completion_tokens": 6}, None, 6),
    ("/v1/responses", {"input": "a", "max_output_tokens": 4, "n_predict": -1}, None, None),
    ("/v1/responses", {"input": "a", "max_output_tokens": None, "max_tokens": 9}, None, None),
    ("/responses", {"input": "a", "max_tokens": 9}, None, 9),
    ("/v1/messages", {"messages": [], "n_predict": -1, "max_tokens": 3}, None, 3),
    ("/v1/messages", {"messages": [], "max_tokens": 3, "n_predict": 500}, None, 3),
    ("/v1/messages", {"messages": [], "n_predict": 5}, None, 4096),
    ("/v1/messages", {"messages": [], "max_tokens": None}, 40, 40),
]
