"""Tree verification: several proposals for one round (branches) merged into a token
tree and checked by the target in ONE cached forward.

The tree: node 0 is the anchor (position t); every branch is a path from it, and
branches that start alike share their nodes (a trie). The target sees the nodes in
insertion order, each at position t + depth, under an attention mask where a node
attends to the whole cache and to its own ancestors only (`tree_mask`, additive: 0 or
the dtype's min, which transformers' eager and sdpa attentions and `sdpa_packed_gqa`
all take as a custom 4D mask: a 4D mask is passed through unchanged by
`transformers.masking_utils`). After verification the accepted path's cache entries
are gathered into positions t..t+a and the rest dropped (`keep_path`), so the cache is
exactly what a linear round over that path would have left.

Rules (each exact):
- greedy: from the anchor, follow the child whose token is the target's argmax; the
  next token is the argmax at the last node reached. One path matches at most, so the
  output is plain greedy decoding's.
- sampling: recursive rejection over the candidates at each node (SpecInfer's
  multi-round speculative sampling): every live branch in order offers its token x
  drawn from its q (one-hot for a deterministic proposal); accept with probability
  min(1, p(x)/q(x)) against the current p, else p <- norm(max(0, p - q)) and the next
  branch tries. Duplicates of a rejected token are tested too (p(x) is 0 by then) so
  the residual still subtracts their q. Every candidate at a node was drawn given the
  path to it, independently of the coins, so the emitted token follows p."""

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch

from dlite.decoding.verify import process_logits, residual_distribution


@dataclasses.dataclass
class Branch:
    """One proposal: tokens, its draft distributions q [n, V] (None: deterministic, or
    greedy), the proposer's name, the per-slot features its calibration reads, and
    (a token drafter's, once the learned drafter ran) the learned drafter's probability
    of its first token."""
    tokens: List[int]
    q: Optional[torch.Tensor]
    source: str
    feats: List[float] = dataclasses.field(default_factory=list)
    agree: Optional[float] = None

    def cut(self, n: int) -> "Branch":
        return Branch(self.tokens[:n], None if self.q is None else self.q[:n], self.source, self.feats[:n],
                      self.agree)


@dataclasses.dataclass
class TokenTree:
    """Nodes in forward order (node 0 = the anchor), each with its parent and depth;
    `paths[b]` = the node ids of branch b's tokens."""
    tokens: List[int]
    parent: List[int]
    depth: List[int]
    paths: List[List[int]]
    children: List[dict]

    @property
    def size(self) -> int:
        """Draft tokens sent to verification (the anchor not counted)."""
        return len(self.tokens) - 1


def build_tree(anchor: int, branches: Sequence[Branch]) -> TokenTree:
    """Merge the branches into a trie rooted at the anchor."""
    tree = TokenTree([int(anchor)], [-1], [0], [], [{}])
    for br in branches:
        node, path = 0, []
        for tok in br.tokens:
            nxt = tree.children[node].get(int(tok))
            if nxt is None:
                nxt = len(tree.tokens)
                tree.tokens.append(int(tok))
                tree.parent.append(node)
                tree.depth.append(tree.depth[node] + 1)
                tree.children.append({})
                tree.children[node][int(tok)] = nxt
            path.append(nxt)
            node = nxt
        tree.paths.append(path)
    return tree


def ancestors(parents: List[int], n: int = None) -> torch.Tensor:
    """[n, n] bool: node i sees node j iff j is i or one of its ancestors (`parents[i]`,
    -1 at the root); n may exceed the nodes (padding slots then see themselves only)."""
    n = len(parents) if n is None else n
    out = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        while p >= 0:
            out[i, p] = True
            p = parents[p]
    return out


def tree_mask(tree: TokenTree, past: int, dtype, device) -> torch.Tensor:
    """Additive mask [1, 1, N, past + N]: every node sees the cache and its ancestors."""
    n = len(tree.tokens)
    allowed = torch.ones(n, past + n, dtype=torch.bool)
    allowed[:, past:] = ancestors(tree.parent)
    mask = torch.zeros(n, past + n, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def tree_positions(tree: TokenTree, start: int, device) -> torch.Tensor:
    return (start + torch.tensor(tree.depth, device=device))[None]


def _walk_greedy(tree: TokenTree, logits: torch.Tensor) -> Tuple[List[int], int]:
    best = logits.argmax(-1).tolist()
    node, path = 0, []
    while best[node] in tree.children[node]:
        node = tree.children[node][best[node]]
        path.append(node)
    return path, best[node]


def _candidates(tree: TokenTree, branches: Sequence[Branch], node: int, alive: List[int]):
    """(branch, its token at this node's depth, its q row or None) for the live branches
    with a token below `node`."""
    d = tree.depth[node]
    return [(b, branches[b].tokens[d], None if branches[b].q is None else branches[b].q[d])
            for b in alive if len(branches[b].tokens) > d]


def _walk_sampling(tree: TokenTree, branches: Sequence[Branch], p_rows: torch.Tensor,
                   generator=None) -> Tuple[List[int], int]:
    node, path, alive = 0, [], list(range(len(branches)))
    while True:
        p = p_rows[node]
        accepted = None
        for b, tok, q in _candidates(tree, branches, node, alive):
            q_x = 1.0 if q is None else float(q[tok])
            u = float(torch.rand(1, generator=generator, device=p.device))
            if u * q_x < float(p[tok]):  # as verify_sampling: no division, q(x) = 0 safe
                accepted = tok
                break
            q_row = q if q is not None else torch.zeros_like(p).index_fill_(0, torch.tensor([tok], device=p.device), 1.0)
            p = residual_distribution(p, q_row.to(p.dtype))
        if accepted is None:
            return path, int(torch.multinomial(p, 1, generator=generator))
        node = tree.children[node][accepted]
        path.append(node)
        alive = [b for b in alive if len(branches[b].tokens) > len(path) - 1
                 and branches[b].tokens[len(path) - 1] == accepted]


def verify_tree(tree: TokenTree, branches: Sequence[Branch], logits: torch.Tensor, temperature: float,
                top_p: float = 1.0, top_k: int = 0, generator=None) -> Tuple[List[int], int]:
    """logits [N, V] (row i judges node i's children) -> (accepted node ids, root to
    leaf; next token)."""
    if temperature <= 0:
        return _walk_greedy(tree, logits)
    return _walk_sampling(tree, branches, process_logits(logits, temperature, top_p, top_k), generator)


def keep_path(cache, start: int, nodes: Sequence[int]) -> None:
    """Keep the cache entries of positions < start, then those of tree nodes `nodes`
    (anchor first), moved to start..start+len(nodes)-1; drop the rest."""
    idx = torch.tensor([start + n for n in nodes])
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name)
            kept = t.index_select(-2, idx.to(t.device))
            t[..., start:start + len(nodes), :] = kept
    extra = cache.get_seq_length() - (start + len(nodes))
    if extra:
        cache.crop(-extra)


def branch_matches(branches: Sequence[Branch], emitted: Sequence[int]) -> List[int]:
    """For each branch, how many of its leading tokens the round's accepted tokens
    confirm (greedy: what that branch alone would have had accepted)."""
    out = []
    for br in branches:
        m = 0
        while m < len(br.tokens) and m < len(emitted) and br.tokens[m] == emitted[m]:
            m += 1
        out.append(m)
    return out
