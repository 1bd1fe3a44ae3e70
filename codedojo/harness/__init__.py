"""The agent harness: IDE-aligned tools served over RPC beside each sandbox, tool-call parsers,
the agent loop with self-summaries, and trajectories."""
