"""Adapter components in P's worker processes (one per TP rank)."""
