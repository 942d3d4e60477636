"""The engine: the operations on this instance's tasks (``engine.engine.TaskEngine``).

Composed of ``registry.LiveTasks`` (which tasks are live here), ``runs.Runs``
(the executions) and ``finals.FinalRetries`` (final states not recorded yet);
``ports`` names what it needs of the layers above. Internal: not API.
"""
