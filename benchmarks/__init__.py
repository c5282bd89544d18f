"""Reproducible benchmarks of collabopt: every figure is a ratio against a baseline measured in the same run.

Run them all with ``python -m benchmarks.run`` (see ``benchmarks/run.py`` and the README).
"""
