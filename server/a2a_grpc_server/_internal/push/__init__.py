"""Push notifications: webhook configs, their screening, and delivery as readers of task logs."""
