"""The egress proxy: every request that leaves a sandbox passes a policy, loses its secrets,
and lands in an audit log.

    from codedojo.egress import EgressPolicy, EgressProxy, EgressProxyConfig
    with EgressProxy(EgressProxyConfig(state_dir=Path("runs/egress"))) as proxy:
        policy = EgressPolicy.from_toml("configs/egress.toml")
        spec = SandboxSpec(image="base", egress=proxy.attachment(policy, secrets={"HF": tok}))

`RemoteEgress(socket).attachment(policy)` does the same against `dojo egress serve`.
"""

from codedojo.egress.policy import EgressPolicy, PolicyError

_LAZY = {
    # mitmproxy is imported only when a proxy is actually built.
    "EgressProxy": "codedojo.egress.proxy",
    "EgressProxyConfig": "codedojo.egress.proxy",
    "ProxyAttachment": "codedojo.egress.proxy",
    "RemoteEgress": "codedojo.egress.control",
    "read_audit": "codedojo.egress.audit",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = ["EgressPolicy", "PolicyError", *_LAZY]
