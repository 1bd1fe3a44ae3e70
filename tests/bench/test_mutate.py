import ast

import pytest

from codedojo.bench.mutate import KINDS, apply_site, find_sites

SRC = '''
LIMIT = 10


def f(items, n, flag=True):
    """Doc."""
    total = 0
    for i in range(0, n):
        if items[i] > 3 and flag:
            total += items[i - 1]
    try:
        total = divmod(total, n)[0]
    except ZeroDivisionError:
        total = -1
    if total > LIMIT:
        raise ValueError("too big")
    return total
'''


def test_every_kind_has_sites_and_each_mutant_parses_and_differs():
    sites = find_sites(SRC)
    kinds = {s.kind for s in sites}
    assert kinds == set(KINDS)
    for s in sites:
        code, applied = apply_site(SRC, s.kind, s.index)
        assert code != SRC, s
        ast.parse(code)
        assert applied == s  # finding and applying walk the tree the same way
        assert '"""Doc."""' in code  # docstrings are never touched


def test_module_level_code_is_not_mutated():
    sites = find_sites(SRC)
    assert all(s.function for s in sites)
    assert all("LIMIT = 10" not in s.before for s in sites)


def test_parameter_defaults_are_not_mutated():
    src = 'def f(x, limit=10, strict=True, step=-1, key=lambda v=0: v):\n    """Doc."""\n    return x\n'
    for s in find_sites(src):
        code, _ = apply_site(src, s.kind, s.index)
        assert code.splitlines()[0] == src.splitlines()[0], s


def test_specific_mutations():
    def only(kind, pred):
        for s in find_sites(SRC):
            if s.kind == kind and pred(s):
                return apply_site(SRC, s.kind, s.index)[0]
        raise AssertionError(kind)

    assert "raise NotImplementedError" in only("remove_body", lambda s: True)
    assert "except UnicodeError" in only("broken_exception", lambda s: s.before.startswith("except"))
    assert "raise ValueError" not in only("broken_exception", lambda s: s.before.startswith("raise"))
    assert "divmod(n, total)" in only("swap_arguments", lambda s: s.before.startswith("divmod"))
    assert "items[i] >= 3" in only("operator_swap", lambda s: s.before == "items[i] > 3")
    assert "if not (total > LIMIT)" in only("invert_condition", lambda s: "total > LIMIT" in s.before)


def test_bad_site_is_an_error():
    with pytest.raises(ValueError, match="no off_by_one site"):
        apply_site(SRC, "off_by_one", 999)
    with pytest.raises(ValueError, match="unknown mutation kind"):
        apply_site(SRC, "nonsense", 0)
