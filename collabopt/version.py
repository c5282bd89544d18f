"""The version of collabopt (a module of its own: the engine and ``doctor`` read it without importing the package)."""

__version__ = "0.1.0"
"""The version of collabopt."""
