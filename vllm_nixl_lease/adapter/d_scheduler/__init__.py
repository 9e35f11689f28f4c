"""Adapter components in D's scheduler process."""
