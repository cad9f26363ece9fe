"""The request path: plan, place (prefix cache, edit policies, splice), decode and the scheduler."""
