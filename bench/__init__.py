"""slotgate's benchmark against a direct connection, nginx and LiteLLM; see bench/README.md."""
