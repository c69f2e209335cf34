"""Quantized checkpoint formats the worker loads (AWQ int4: awq.py)."""
