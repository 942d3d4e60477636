"""The per-task frame log (``tasklog.TaskLog``), its readers and its memory budget.

Internal: not API.
"""
