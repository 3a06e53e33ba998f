"""The managed llama.cpp: one or several local llama-server engines that slotgate starts, watches
and stops (`process`, `engines`), the model they serve (`model`), and the child process each
runs in (`child`, run as a script: it imports nothing of slotgate). Standard library only, so
that an engine can be started before anything else is imported; it must not know the gate.
"""
