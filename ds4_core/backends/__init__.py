"""Backends shipped with ds4-core (only the numpy reference; GPU backends are plugins)."""
