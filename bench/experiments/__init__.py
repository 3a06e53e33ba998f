"""Finished investigations: each answered one question; the answers are in bench/README.md."""
