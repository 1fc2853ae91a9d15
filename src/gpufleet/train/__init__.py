"""Training-side API (the worker's ``Run``) and the supervisor that restarts workers."""
