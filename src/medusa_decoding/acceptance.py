"""Acceptance rules: pure functions from one verification pass to (accepted path, next token).

Every rule takes the tree's node tokens [N+1] and the base model's logits at every node [N+1, V]
(logits[i] is the distribution of the token after node i) and returns the accepted node indices
(root first) and the token that follows the last of them. `p` is the base model's distribution after
temperature, top-k and top-p: the same one plain sampling draws from.
"""

import torch

from .config import GenerationConfig
from .tree import PAD, Tree

ARGMAX_CHUNK = 64  # logits a chunk in `argmax`


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> [...]: the first largest logit's index, as `argmax`. On a CPU a reduction with indices runs
    one lane at a time, a maximum alone runs vectorised: the maxima of chunks of ARGMAX_CHUNK logits, the first chunk
    that holds the largest, the first of its logits that is it."""
    if logits.device.type != "cpu" or logits.shape[-1] % ARGMAX_CHUNK:
        return logits.max(-1).indices
    chunks = logits.unflatten(-1, (-1, ARGMAX_CHUNK))  # [..., V / ARGMAX_CHUNK, ARGMAX_CHUNK]
    maxima = chunks.amax(-1)
    largest = maxima.amax(-1, keepdim=True)
    first = (maxima == largest).byte().argmax(-1)  # the first chunk holding the largest logit
    chunk = chunks.gather(-2, first[..., None, None].expand(*first.shape, 1, ARGMAX_CHUNK)).squeeze(-2)
    return first * ARGMAX_CHUNK + (chunk == largest).byte().argmax(-1)


def target_probs(logits: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """p: [..., V]. Temperature 0 gives the one-hot argmax, so every rule reduces to greedy."""
    if config.temperature == 0:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).to(logits.dtype)
    logits = logits.float() / config.temperature
    if config.top_k:
        kth = logits.topk(min(config.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if config.top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= config.top_p  # keeps at least the top token
        probs = probs.masked_fill(drop.scatter(-1, order, drop), 0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from probs [V] (any non-negative weights) by its inverse CDF: one uniform and a cumulative sum, in
    float64: on a CPU torch.multinomial costs many times more, a large share of a sampled batch's step over a large
    vocabulary. A token of zero weight is never drawn: its interval of the CDF is empty, and a uniform that rounds
    onto the total falls back onto the last token that has weight."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand((), dtype=torch.float64, generator=generator, device=probs.device) * cdf[-1]
    return int(torch.minimum(torch.searchsorted(cdf, u, right=True), torch.searchsorted(cdf, cdf[-1])))


def longest_accepted_path(accepted: torch.Tensor, tree: Tree) -> torch.Tensor:
    """accepted: [N+1] bool, node i accepted given its parent -> the longest root path of accepted nodes."""
    leaf_paths = tree.leaf_paths  # [L, D+1]
    ok = accepted[leaf_paths.clamp_min(0)] & (leaf_paths != PAD)  # padding is never accepted
    ok[:, 0] = True  # the root was chosen last step
    lengths = ok.long().cumprod(-1).sum(-1)  # [L]
    best = int(lengths.argmax())
    return leaf_paths[best, : int(lengths[best])]


def greedy(tokens, logits, tree: Tree, config: GenerationConfig, generator=None):
    """Lossless: accept a node when it equals the argmax after its parent. Siblings hold distinct tokens (a head's
    top-k, grafted drafts merged where they agree), so at most one child of a node is accepted: the path is walked
    from the root on the host, a few list reads (where two siblings are both accepted, the longest path decides)."""
    best, listed = argmax(logits).tolist(), tokens.tolist()  # [N+1] each
    path = [0]
    while len(accepted := [child for child in tree.children[path[-1]] if listed[child] == best[path[-1]]]) == 1:
        path.append(accepted[0])
    if accepted:  # two siblings accepted
        path = longest_accepted_path(tokens == tokens.new_tensor(best)[tree.parents.clamp_min(0)], tree).tolist()
    return torch.tensor(path), best[path[-1]]


def typical(tokens, logits, tree: Tree, config: GenerationConfig, generator=None):
    """MEDUSA's typical acceptance: accept x when p(x) > min(epsilon, delta * exp(-H(p)))."""
    probs = target_probs(logits, config)  # [N+1, V]
    entropy = -torch.special.xlogy(probs, probs).sum(-1)
    threshold = torch.minimum(torch.full_like(entropy, config.typical_epsilon), config.typical_delta * (-entropy).exp())
    parents = tree.parents.clamp_min(0)
    accepted = probs[parents, tokens] > threshold[parents]
    path = longest_accepted_path(accepted, tree)
    return path, sample(probs[path[-1]], generator)


def rejection(tokens, logits, tree: Tree, config: GenerationConfig, generator=None):
    """Exact: recursive rejection sampling over siblings (SpecInfer), so output follows p exactly.

    A candidate x is a deterministic draft (q = one-hot at x): accept it with probability p(x); on
    rejection remove x from p and renormalise, then try the next sibling; when every sibling is
    rejected, sample the next token from what remains of p.
    """
    probs = target_probs(logits, config)  # [N+1, V]
    node, path = 0, [0]
    p = probs[0].clone()
    while True:
        for child in tree.children[node]:
            x = int(tokens[child])
            if float(torch.rand((), generator=generator)) < p[x]:
                node = child
                path.append(child)
                p = probs[child].clone()
                break
            p[x] = 0
            p = p / p.sum()
        else:
            return torch.tensor(path), sample(p, generator)


RULES = {"greedy": greedy, "typical": typical, "rejection": rejection}
