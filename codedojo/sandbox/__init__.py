"""Sandboxes: layered read-only images under overlayfs, namespaces and cgroup limits; exec,
files, snapshot, fork, restore; a service and its client with the same interface.

    from codedojo.sandbox import LocalProvider, SandboxSpec
    provider = LocalProvider(root="/tmp/store")          # or $CODEDOJO_SANDBOX_ROOT
    image = provider.images.from_directory("repo", name="repo")   # -> /workspace
    sb = provider.create(SandboxSpec(image="repo"))
    sb.exec("pytest -q"); sb.write_file("x.py", "..."); snap = sb.snapshot(); sb.fork(4, snap)
    sb.destroy()
"""

from codedojo.sandbox.base import (
    WORKSPACE,
    Change,
    EgressAttachment,
    EgressBinding,
    ExecResult,
    FileInfo,
    FileTooLarge,
    Limits,
    NotFound,
    Sandbox,
    SandboxError,
    SandboxProvider,
    SandboxSpec,
    Shell,
)


def __getattr__(name: str):
    # Imported lazily: the local kind compiles its helper and touches cgroups on first use.
    if name in ("LocalProvider", "LocalSandbox"):
        from codedojo.sandbox import local

        return getattr(local, name)
    if name in ("Image", "ImageStore"):
        from codedojo.sandbox import images

        return getattr(images, name)
    if name == "SandboxClient":
        from codedojo.sandbox.client import SandboxClient

        return SandboxClient
    raise AttributeError(name)


__all__ = [
    "WORKSPACE", "Change", "EgressAttachment", "EgressBinding", "ExecResult", "FileInfo",
    "FileTooLarge", "Limits", "NotFound", "Sandbox", "SandboxError", "SandboxProvider",
    "SandboxSpec", "Shell",
    "LocalProvider", "LocalSandbox", "Image", "ImageStore", "SandboxClient",
]
