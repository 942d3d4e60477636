"""What every layer shares about a task: operations on it, sizes, scopes, the caller, names.

Internal: not API.
"""
