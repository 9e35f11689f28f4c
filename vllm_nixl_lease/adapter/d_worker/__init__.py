"""Adapter components in D's worker processes (one per TP rank)."""
