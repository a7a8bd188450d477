"""The paged KV pool on the device and the import of a handoff's llama.cpp KV bytes into it."""
