"""Adapters: ``collabopt.integrations.pytorch``, ``.accelerate`` and ``.lightning`` (import the one you use)."""
