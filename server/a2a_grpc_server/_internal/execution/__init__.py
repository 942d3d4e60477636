"""A task's execution: ``LiveTask``, its supervisor, mailbox, parking, quotas, pacing.

Internal: not API.
"""
