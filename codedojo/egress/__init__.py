"""The egress proxy: every request that leaves a sandbox passes a policy, loses its secrets,
and lands in an audit log."""
