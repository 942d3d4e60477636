"""Benchmarks: one command each, printing a table and writing JSON (see README.md)."""
