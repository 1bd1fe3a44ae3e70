"""Sandboxes: layered read-only images under overlayfs, namespaces and cgroup limits; exec,
files, snapshot, fork, restore; a service and its client with the same interface."""
