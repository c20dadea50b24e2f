"""Chains as people read them: one line of text, or a Mermaid flowchart.

Both are drawn from the registered :class:`Chain` (not from the file), so what is drawn is
exactly what runs.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import count

from ..container._routes import Route
from ..pipes._graph import topological_order
from ..pipes._pipe import Pipe
from ..pipes._stages import Chain, Node, Parallel, Serial

__all__ = ["chain_text", "mermaid"]


def chain_text(root: Serial) -> str:
    """``get_user > any_of(price_a, price_b) > graph(A: a; B: b after A)``."""
    return " > ".join(_text(child) for child in root.children)


def _text(node: Node) -> str:
    if isinstance(node, Pipe):
        return node.name
    if isinstance(node, Serial):
        inner = " > ".join(_text(child) for child in node.children)
        return f"serial{_options(node)}({inner})" if node.timeout else f"({inner})"
    if node.kind == "graph":
        parts = []
        for i, (name, branch) in enumerate(zip(node.names, node.branches, strict=True)):
            text = f"{name}: {_branch_text(branch)}"
            if node.parents[i]:
                text += " after " + ", ".join(node.names[p] for p in node.parents[i])
            if node.detach[i]:
                text += " detached"
            parts.append(text)
        return f"graph{_options(node)}({'; '.join(parts)})"
    branches = ", ".join(_branch_text(b) for b in node.branches)
    return f"{node.kind}{_options(node)}({branches})"


def _branch_text(branch: Serial) -> str:
    if len(branch.children) == 1 and branch.timeout is None:
        return _text(branch.children[0])
    return _text(branch)


def _options(node: Serial | Parallel) -> str:
    options = []
    if isinstance(node, Parallel):
        if node.kind == "quorum":
            options.append(f"k={node.k}")
        if node.settle:
            options.append("settle")
        if node.max_concurrency is not None:
            options.append(f"max_concurrency={node.max_concurrency}")
    if node.timeout is not None:
        options.append(f"timeout={node.timeout:g}s")
    return f"[{', '.join(options)}]" if options else ""


def mermaid(route: Route, chain: Chain, describe: Callable[[Pipe], str]) -> str:
    """A Mermaid flowchart of ``route``'s chain; ``describe`` gives a pipe's second label
    line (e.g. the HTTP call it makes)."""
    return _Drawing(describe).draw(route, chain)


def _label(text: str) -> str:
    escaped = text.replace("&", "#amp;").replace('"', "#quot;")
    return '"' + escaped.replace("<", "#lt;").replace(">", "#gt;").replace("\n", "<br/>") + '"'


class _Drawing:
    def __init__(self, describe: Callable[[Pipe], str]) -> None:
        self.describe = describe
        self.lines: list[str] = []
        self._ids = count(1)

    def new(self, shape: str, text: str) -> str:
        node_id = f"n{next(self._ids)}"
        opening, closing = shape.split("|")
        self.lines.append(f"    {node_id}{opening}{_label(text)}{closing}")
        return node_id

    def edges(self, sources: list[str], target: str, arrow: str = "-->") -> None:
        self.lines.extend(f"    {source} {arrow} {target}" for source in sources)

    def draw(self, route: Route, chain: Chain) -> str:
        start = self.new("([|])", f"{route.method} {route.path}\nmode: {route.mode}")
        exits = self.node(chain.root, [start])
        result = "whole state" if chain.result is None else f"state.{chain.result}"
        self.edges(exits, self.new("([|])", f"respond: {result}"))
        return "\n".join(["flowchart TD", *self.lines])

    def node(self, node: Node, entries: list[str], arrow: str = "-->") -> list[str]:
        if isinstance(node, Pipe):
            second = self.describe(node)
            target = self.new("[|]", f"{node.name}\n{second}" if second else node.name)
            self.edges(entries, target, arrow)
            return [target]
        if isinstance(node, Serial):
            for i, child in enumerate(node.children):
                entries = self.node(child, entries, arrow if i == 0 else "-->")
            return entries
        return self.parallel(node, entries, arrow)

    def parallel(self, node: Parallel, entries: list[str], arrow: str) -> list[str]:
        fork = self.new("{{|}}", f"{node.kind}{_options(node)}")
        self.edges(entries, fork, arrow)
        n = len(node.branches)
        joins = {"any_of": "first success", "all_of": "all succeed", "quorum": f"{node.k} of {n}"}
        if node.settle:
            joins["all_of"] = "all settle"
        if node.kind != "graph":
            ends = [x for branch in node.branches for x in self.node(branch, [fork])]
        else:
            ends = self.graph(node, fork)
        join = self.new("((|))", joins.get(node.kind, "join"))
        self.edges(ends, join)
        return [join]

    def graph(self, node: Parallel, fork: str) -> list[str]:
        parents = {i: list(p) for i, p in enumerate(node.parents)}
        # A node whose only children are detached still ends the graph's joined part.
        has_children = {p for i, ps in enumerate(node.parents) if not node.detach[i] for p in ps}
        exits: dict[int, list[str]] = {}
        ends: list[str] = []
        for i in topological_order(parents):
            entries = [x for p in parents[i] for x in exits[p]] or [fork]
            arrow = "-. detached .->" if node.detach[i] else "-->"
            branch = node.branches[i]
            name = node.names[i]
            only = branch.children[0] if len(branch.children) == 1 else None
            if isinstance(only, Pipe) and branch.timeout is None:
                second = self.describe(only)
                text = f"{name}: {only.name}" + (f"\n{second}" if second else "")
                exits[i] = [self.new("[|]", text)]
                self.edges(entries, exits[i][0], arrow)
            else:
                self.lines.append(f"    subgraph {fork}_{i} [{_label(name)}]")
                exits[i] = self.node(branch, entries, arrow)
                self.lines.append("    end")
            if not node.detach[i] and i not in has_children:
                ends.extend(exits[i])
        return ends
