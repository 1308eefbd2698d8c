"""Output: readable tables, JSON files and PNG plots."""
