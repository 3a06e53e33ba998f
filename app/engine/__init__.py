"""The managed llama.cpp: one or several local llama-server engines that slotgate starts, watches
and stops, and the demo model. Standard library only, so that an engine can be started before
anything else is imported; it must not know the gate.
"""
