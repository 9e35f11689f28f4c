"""Adapter components in P's scheduler process."""
