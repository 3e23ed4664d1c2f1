"""What crosses a stage boundary: a tensor, or tuples, lists and dicts (string keys) of them.

`flatten` splits such a tree into its tensors (the leaves, in a fixed order) and a
structure that is plain JSON data, so the structure can travel in a message header and
`unflatten` can rebuild the tree on the other side.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

Tree = Any  # a Tensor, or a tuple / list / dict (str keys) of trees
Structure = Any  # "T" for a tensor; {"tuple": [...]}, {"list": [...]}, {"dict": [[key, structure], ...]}
LEAF = "T"


def flatten(tree: Tree) -> tuple[list[Tensor], Structure]:
    """The tensors of `tree` in order, and its structure; ValueError naming what is not allowed."""
    leaves: list[Tensor] = []
    return leaves, _structure(tree, leaves, where="output")


def unflatten(structure: Structure, leaves: list[Tensor]) -> Tree:
    rest = iter(leaves)
    tree = _build(structure, rest)
    if next(rest, None) is not None:
        raise ValueError("more leaves than the structure holds")
    return tree


def tree_map(fn: Callable[[Tensor], Tensor], tree: Tree) -> Tree:
    leaves, structure = flatten(tree)
    return unflatten(structure, [fn(leaf) for leaf in leaves])


def is_tree(value: object) -> bool:
    try:
        flatten(value)
    except ValueError:
        return False
    return True


def describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of ({', '.join(describe(v) for v in value)})"
    if isinstance(value, dict):
        return "a dict of (" + ", ".join(f"{k!r}: {describe(v)}" for k, v in value.items()) + ")"
    return f"a {type(value).__name__}"


def _structure(tree: Tree, leaves: list[Tensor], *, where: str) -> Structure:
    if isinstance(tree, Tensor):
        leaves.append(tree)
        return LEAF
    if isinstance(tree, (tuple, list)):
        kind = "tuple" if isinstance(tree, tuple) else "list"
        return {kind: [_structure(v, leaves, where=f"{where}[{i}]") for i, v in enumerate(tree)]}
    if isinstance(tree, dict):
        bad = [k for k in tree if not isinstance(k, str)]
        if bad:
            raise ValueError(
                f"{where} is a dict with a non-string key {bad[0]!r}; only string keys can cross a stage boundary"
            )
        return {"dict": [[k, _structure(v, leaves, where=f"{where}[{k!r}]")] for k, v in tree.items()]}
    raise ValueError(
        f"{where} is {describe(tree)}; only tensors, and tuples, lists and dicts of them, cross a stage boundary"
    )


def _build(structure: Structure, leaves: Any) -> Tree:
    if structure == LEAF:
        leaf = next(leaves, None)
        if leaf is None:
            raise ValueError("fewer leaves than the structure holds")
        return leaf
    ((kind, children),) = structure.items()
    if kind == "dict":
        return {key: _build(child, leaves) for key, child in children}
    items = [_build(child, leaves) for child in children]
    return tuple(items) if kind == "tuple" else items
