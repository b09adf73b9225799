"""Integrations with engines and libraries (imported on demand, never by the core)."""
