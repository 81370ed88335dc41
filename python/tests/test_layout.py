"""The package's layout, read from its source with `ast` (nothing imported): the imports between
larder's modules, function-level ones included, form no cycle; no module takes a `_private`
name from another; and no module rewrites `sys.modules`."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "larder"


def modules() -> dict:
    """{dotted name: parsed source} of every module under python/larder."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = (path, ast.parse(path.read_text(), str(path)))
    return out


def _absolute(name: str, current: str, is_package: bool, level: int) -> str:
    """The absolute module a `from ... import` names (relative ones resolved from `current`)."""
    if level == 0:
        return name
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _known(name: str, known) -> str:
    """`name`, or the longest prefix of it that is a module of the package (`import a.b.c` of
    a name that is no module imports its package)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts)


def imports(name: str, tree: ast.AST, is_package: bool, known) -> list:
    """(imported module, names taken from it, line) for every import of a larder module in
    `tree`, at any depth; a `from P import m` of a module m counts as an import of P.m."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name, known)
                if target:
                    out.append((target, [], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node.module or "", name, is_package, node.level)
            if not _known(source, known):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in known:
                    out.append((sub, [], node.lineno))
                else:
                    out.append((_known(source, known), [alias.name], node.lineno))
    return out


def module_aliases(name: str, tree: ast.AST, is_package: bool, known) -> dict:
    """{local name: larder module} for the names a module binds to larder modules."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in known:
                    out[alias.asname] = alias.name
                elif not alias.asname and alias.name.split(".")[0] == "larder":
                    out["larder"] = "larder"
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node.module or "", name, is_package, node.level)
            for alias in node.names:
                if f"{source}.{alias.name}" in known:
                    out[alias.asname or alias.name] = f"{source}.{alias.name}"
    return out


def _dotted(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def graph():
    found = modules()
    known = set(found)
    edges, private = {}, []
    for name, (path, tree) in found.items():
        is_package = path.name == "__init__.py"
        edges[name] = set()
        for target, names, line in imports(name, tree, is_package, known):
            if target != name:
                edges[name].add(target)
            for taken in names:
                if _private(taken) and target != name:
                    private.append(f"{path.name}:{line}: from {target} import {taken}")
        aliases = module_aliases(name, tree, is_package, known)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                owner = _dotted(node.value)
                head, _, rest = owner.partition(".")
                module = aliases.get(head)
                if module is None:
                    continue
                module = f"{module}.{rest}" if rest else module
                if module in known and module != name:
                    private.append(f"{path.name}:{node.lineno}: {owner}.{node.attr}")
    return found, edges, private


def cycle(edges: dict) -> list:
    """A cycle of the graph (its modules in order, the first again at the end), or []."""
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = "done"
        return []

    for n in sorted(edges):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return []


def test_the_imports_between_larders_modules_form_no_cycle():
    found, edges, _ = graph()
    # The parse sees the package: its modules and imports it is known to have.
    assert {"larder", "larder.client", "larder.torch", "larder.torch.dataset", "larder.timm"} <= set(found)
    assert "larder.batch" in edges["larder.client"] and "larder.client" in edges["larder"]
    assert "larder.folders" in edges["larder.timm"], "function-level and top-level imports alike"
    assert cycle(edges) == [], " -> ".join(cycle(edges))


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    tree = ast.parse("def f():\n    from larder.client import _hidden\n    import larder.torch as lt\n    lt._x()\n")
    known = {"larder", "larder.client", "larder.torch", "larder.other"}
    assert imports("larder.other", tree, False, known) == [("larder.client", ["_hidden"], 2), ("larder.torch", [], 3)]
    assert module_aliases("larder.other", tree, False, known) == {"lt": "larder.torch"}


def test_no_module_takes_a_private_name_from_another():
    _, _, private = graph()
    assert private == []


def test_no_module_rewrites_sys_modules():
    for name, (path, tree) in modules().items():
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for t in targets:
                assert not (isinstance(t, ast.Subscript) and _dotted(t.value) == "sys.modules"), \
                    f"{path}:{node.lineno} writes sys.modules"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                assert not (_dotted(node.func.value) == "sys.modules"
                            and node.func.attr in ("update", "setdefault", "pop", "__setitem__")), \
                    f"{path}:{node.lineno} changes sys.modules"
