"""The split backward: an input-gradient pass now, weight passes later, no work done twice.

How the split works. The input pass walks the autograd graph from the chunk's output
back to its input. Call a node *on the input path* when the input's gradient flows
through it. Where such a node also feeds a parameter (a matmul feeds its weight, a
LayerNorm its affine parameters), the input pass records the gradient arriving at that
node and asks autograd for the input gradient alone, so the node computes only its
input-side outputs. The weight pass later restarts autograd at exactly those nodes,
with the recorded gradients, asking for the parameters alone. Each node's work is done
once, split between the two passes. The graph (and so the activations) is held until
the weight pass ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

Grads = tuple[Tensor | None, ...]


@dataclass
class WeightPass:
    """One autograd call that accumulates some parameters' gradients."""

    roots: list[GradientEdge]
    grads: list[Tensor]
    params: list[nn.Parameter]
    pinned: dict[Node, Grads]  # where one root's gradient also reaches another root

    def run(self) -> None:
        if not self.params:
            return
        handles = [node.register_prehook(_constant(grads)) for node, grads in self.pinned.items()]
        try:  # accumulated by autograd, so each parameter's post-accumulate hooks fire as it is done
            torch.autograd.backward(self.roots, self.grads, retain_graph=True, inputs=self.params)
        finally:
            for handle in handles:
                handle.remove()


def split_backward(
    *, roots: list[Tensor], grads: list[Tensor], leaves: list[Tensor], params: list[nn.Parameter]
) -> tuple[list[Tensor], list[WeightPass]]:
    """The gradients of ``leaves`` now (zeros where unused), and the weight passes that finish the job later."""
    graph = _children([root.grad_fn for root in roots if root.grad_fn is not None])
    on_input_path: set[Node] = set()
    for leaf in leaves:
        on_input_path |= _ancestors(graph, get_gradient_edge(leaf).node)
    param_ids = {id(p) for p in params}
    groups: list[tuple[list[Node], set[int]]] = []
    for node in graph:
        if node not in on_input_path:
            continue
        weight_side = [child for child in graph[node] if child not in on_input_path]
        owned = {pid for child in weight_side for pid in _params_below(graph, child, param_ids)}
        if not owned:
            continue
        joined = [g for g in groups if g[1] & owned]
        groups = [g for g in groups if not g[1] & owned]
        groups.append(([n for g in joined for n in g[0]] + [node], owned.union(*(g[1] for g in joined))))

    arrived: dict[Node, Grads] = {}
    handles = [node.register_prehook(_record(arrived, node)) for nodes, _ in groups for node in nodes]
    try:
        found = torch.autograd.grad(roots, leaves, grads, retain_graph=True, allow_unused=True)
        dx = [g if g is not None else torch.zeros_like(leaf) for g, leaf in zip(found, leaves)]
    finally:
        for handle in handles:
            handle.remove()

    passes = []
    for nodes, owned in groups:
        reached = [n for n in nodes if n in arrived]
        edges = [(GradientEdge(n, i), g) for n in reached for i, g in enumerate(arrived[n]) if g is not None]
        pinned = {n: arrived[n] for n in reached} if len(reached) > 1 else {}
        if edges:
            chosen = [p for p in params if id(p) in owned]
            roots, grads = [e for e, _ in edges], [g for _, g in edges]
            passes.append(WeightPass(roots=roots, grads=grads, params=chosen, pinned=pinned))
    return dx, passes


def _children(roots: list[Node]) -> dict[Node, list[Node]]:
    """Every node reachable from ``roots``, in discovery order, with its children."""
    graph: dict[Node, list[Node]] = {}
    stack = list(reversed(roots))
    while stack:
        node = stack.pop()
        if node not in graph:
            graph[node] = [child for child, _ in node.next_functions if child is not None]
            stack.extend(graph[node])
    return graph


def _ancestors(graph: dict[Node, list[Node]], target: Node) -> set[Node]:
    """``target`` and every node of ``graph`` it is reachable from."""
    parents: dict[Node, list[Node]] = {}
    for node, children in graph.items():
        for child in children:
            parents.setdefault(child, []).append(node)
    found = {target}
    stack = [target]
    while stack:
        for parent in parents.get(stack.pop(), []):
            if parent not in found:
                found.add(parent)
                stack.append(parent)
    return found


def _params_below(graph: dict[Node, list[Node]], start: Node, param_ids: set[int]) -> set[int]:
    """ids of the parameters whose accumulators ``start`` reaches."""
    found: set[int] = set()
    seen = {start}
    stack = [start]
    while stack:
        node = stack.pop()
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in param_ids:
            found.add(id(variable))
        for child in graph.get(node, []):
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return found


def _record(store: dict[Node, Grads], node: Node) -> Callable[[Grads], None]:
    def hook(grads: Grads) -> None:
        store[node] = grads

    return hook


def _constant(grads: Grads) -> Callable[[Grads], Grads]:
    return lambda _: grads


def note_storages(store: dict[int, int]) -> Callable[[Tensor], Tensor]:
    """A pack hook that notes each storage the graph saves (data pointer: bytes) and saves the tensor detached.

    The graph holds its hooks until it is freed, and the split backward never frees it by
    a backward without ``retain_graph``: a hook that kept the tensors, or saved a node's
    own output (tanh, softmax) with its ``grad_fn``, would hold the graph through C++, a
    cycle that Python's collector cannot see. The detached tensor shares storage and
    version counter, not history.
    """

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        store[storage.data_ptr()] = storage.nbytes()
        return tensor.detach()

    return pack


def noting(*notes: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """A pack hook that notes each saved storage with every one of `notes` (each one keeps it detached)."""

    def pack(tensor: Tensor) -> Tensor:
        for note in notes:
            tensor = note(tensor)
        return tensor

    return pack


def unchanged(tensor: Tensor) -> Tensor:
    return tensor
