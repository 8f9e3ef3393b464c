"""The shape of the source: no import cycle among its modules (imports inside functions count,
those under `if TYPE_CHECKING:` do not), and no module over 1,000 lines but the two drafts'
codec tables. A cycle makes two modules one in all but name; a long module, several concepts.

In the MOQT QUIC binding (kvsp_moq/moqt/quic) annotation-only imports count too, and the
table of live requests of ConnectionCore is written by its own methods only: the handles
register and forget themselves through them, and the connection sees them only through
the RequestHandle protocol."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvsp_moq", "relay", "index", "pc", "agent")
#: the message codecs of drafts 14 and 18: one table of messages each, long by nature
LONG_ALLOWED = {"kvsp_moq/moqt/d14/messages.py", "kvsp_moq/moqt/d18/messages.py"}
MAX_LINES = 1000


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path], *, typing_too: bool = False) -> set[str]:
    """The modules of `known` that `name` imports; `from P import m` counts as importing P.m
    when that is a module (not P itself, whose names the import reads). Imports under
    `if TYPE_CHECKING:` count only with `typing_too`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = set() if typing_too else {
        id(n) for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            targets = subs + ([base] if len(subs) < len(node.names) else [])
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_source_modules() -> None:
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert cycles(graph) == []


def test_no_module_over_a_thousand_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in modules().values()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert set(long) <= LONG_ALLOWED, long


QUIC = "kvsp_moq.moqt.quic"
#: ConnectionCore's table of live requests, and the methods allowed to write and to read it
TABLE = "_request_table"
TABLE_MODULE = "kvsp_moq/moqt/quic/core.py"
TABLE_WRITERS = {"ConnectionCore.__init__", "ConnectionCore.register", "ConnectionCore.forget"}
TABLE_READERS = {"ConnectionCore.register", "ConnectionCore.request_handle", "ConnectionCore.request_handles"}
MUTATORS = {"pop", "popitem", "clear", "setdefault", "update", "__setitem__", "__delitem__"}


def test_no_cycle_in_the_quic_binding_even_for_annotations() -> None:
    known = modules()
    quic = {name: path for name, path in known.items() if name == QUIC or name.startswith(QUIC + ".")}
    graph = {name: imports(name, path, known, typing_too=True) & set(quic) for name, path in quic.items()}
    assert {"kvsp_moq.moqt.quic.core", "kvsp_moq.moqt.quic.handles"} <= set(graph)
    assert cycles(graph) == []


def table_uses(source: str) -> list[tuple[str, bool]]:
    """Each use of the attribute TABLE in `source`: the qualified name of the function it
    is in ("" at module level) and whether it writes the table (assigns or deletes it or
    an item of it, or calls a mutating method on it)."""
    tree = ast.parse(source)
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    uses = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr == TABLE):
            continue
        up = parent.get(node)
        write = (
            isinstance(node.ctx, (ast.Store, ast.Del))
            or (isinstance(up, ast.Subscript) and up.value is node and isinstance(up.ctx, (ast.Store, ast.Del)))
            or (isinstance(up, ast.Attribute) and up.attr in MUTATORS and isinstance(parent.get(up), ast.Call))
        )
        names = []
        scope = up
        while scope is not None:
            if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(scope.name)
            scope = parent.get(scope)
        uses.append((".".join(reversed(names)), write))
    return uses


def test_the_table_use_finder_tells_writes_from_reads() -> None:
    source = """
class C:
    def a(self):
        self._request_table = {}
        self._request_table[1] = 2
        del self._request_table[1]
        self._request_table.pop(1, None)
    def b(self):
        return self._request_table.get(1), list(self._request_table.values())
"""
    assert sorted(table_uses(source)) == [("C.a", True)] * 4 + [("C.b", False)] * 2


def test_only_the_table_methods_touch_the_request_table() -> None:
    touched = {}
    for package in PACKAGES + ("tests",):
        for path in sorted((ROOT / package).rglob("*.py")):
            uses = table_uses(path.read_text(encoding="utf-8"))
            if uses:
                touched[str(path.relative_to(ROOT))] = uses
    assert set(touched) == {TABLE_MODULE}
    uses = touched[TABLE_MODULE]
    assert {name for name, write in uses if write} <= TABLE_WRITERS
    assert {name for name, write in uses if not write} <= TABLE_READERS


def test_every_profile_switch_is_read() -> None:
    """A draft difference with a switch that nothing reads is a difference nobody implemented."""
    from dataclasses import fields

    from kvsp_moq.moqt.d18.profiles import Profile

    sources = "\n".join(p.read_text() for d in ("kvsp_moq", "relay") for p in (ROOT / d).rglob("*.py")
                        if p.name != "profiles.py")
    unread = [f.name for f in fields(Profile) if f.name != "draft" and f".{f.name}" not in sources]
    assert not unread, unread
