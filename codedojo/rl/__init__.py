"""Agentic RL: advantages, loss, trainer step, the four services, weight sync, launchers."""
