"""Policies (which ready action runs next), the arbiter that applies them, and TP agreement."""
