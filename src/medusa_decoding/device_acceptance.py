"""acceptance.py's rules for a batch of rows in tensor ops alone, no read of the device: what a compiled step runs
inside its graph (compiled.verify_graph, compiled.device_graph).

Each rule takes the rows' tree tokens [B, T] and padded tree tensors (tree.padded: depths, parents [B, T], attention,
chains [B, T, T]) and returns the step's outcome [B, 2 + T]: the accepted count, the token after the path, then the
path's node indices (continued by the chains' padding past the count). Random draws come from a counter-based hash of
(the row's key, its length, the draw's index) rather than a generator: the step keeps no random state, and a seeded
row draws the same numbers alone or in a batch.
"""

import torch

MASK = 0xFFFFFFFF  # the hash works on 32-bit words held in int64 tensors


def deepest(accepted: torch.Tensor, depths: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """accepted [B, T] (a node given its parent; the root and padding stand) -> [B] the deepest node whose whole path
    is accepted, the first in node order among equals (the root where none is)."""
    good = ~(attention & ~accepted[:, None, :]).any(-1)
    return (good * (depths + 1)).argmax(-1)


def outcome(best: torch.Tensor, after: torch.Tensor, depths: torch.Tensor, chains: torch.Tensor) -> torch.Tensor:
    """The step's outcome [B, 2 + T] from each row's last accepted node `best` [B] and the token after it [B]."""
    rows = torch.arange(len(best), device=best.device)
    return torch.cat([depths[rows, best][:, None] + 1, after[:, None], chains[rows, best]], dim=1)


def accept_greedy(tokens: torch.Tensor, argmax: torch.Tensor, depths: torch.Tensor, parents: torch.Tensor,
                  attention: torch.Tensor, chains: torch.Tensor) -> torch.Tensor:
    """acceptance.greedy: argmax [B, T] is the base model's token after each node. Siblings hold distinct tokens,
    so greedy accepts one chain."""
    best = deepest((tokens == argmax.gather(1, parents)) | (depths == 0), depths, attention)
    return outcome(best, argmax.gather(1, best[:, None])[:, 0], depths, chains)


def accept_sampled(tokens: torch.Tensor, logits: torch.Tensor, lengths: torch.Tensor, depths: torch.Tensor,
                   parents: torch.Tensor, attention: torch.Tensor, chains: torch.Tensor, temperature: torch.Tensor,
                   top_k: torch.Tensor, top_p: torch.Tensor, typical: torch.Tensor, epsilon: torch.Tensor,
                   delta: torch.Tensor, key: torch.Tensor, filters: bool) -> torch.Tensor:
    """acceptance.rejection, or acceptance.typical where `typical` [B], per row over logits [B, T, V] at its
    temperature, top_k, top_p, epsilon and delta [B] (temperature 0: the argmax, where both rules are greedy).
    lengths [B] and key [B] pick the row's random draws; filters: whether any row has top_k or top_p (a sort of
    every node's logits)."""
    probs = target_probs(logits, temperature, top_k, top_p, filters)  # [B, T, V]
    vocab, nodes = probs.shape[-1], tokens.shape[1]
    draws = uniforms(key, lengths, nodes)  # one per candidate, and the root's for the token after the path
    p_token = probs.flatten(1).gather(1, parents * vocab + tokens)  # [B, T]: each candidate's p after its parent
    candidate = depths > 0  # not the root, not padding
    order = torch.arange(nodes, device=tokens.device)
    before = (parents[:, :, None] == parents[:, None, :]) & candidate[:, None, :] & (order[:, None] > order)[None]
    # rejection: siblings are tried by rank, each with chance p(x) / (the mass left once those before it are removed)
    chance = p_token / (1 - (before * p_token[:, None, :]).sum(-1)).clamp_min(torch.finfo(probs.dtype).tiny)
    taken = candidate & (draws < chance)
    first = taken & ~(before & taken[:, None, :]).any(-1)
    # typical: x when p(x) > min(epsilon, delta * exp(-H(p))) after its parent
    entropy = -torch.special.xlogy(probs, probs).sum(-1)  # [B, T]
    threshold = torch.minimum(epsilon[:, None], delta[:, None] * (-entropy).exp())
    passes = candidate & (p_token > threshold.gather(1, parents))
    best = deepest(torch.where(typical[:, None], passes, first) | ~candidate, depths, attention)
    rows = torch.arange(len(best), device=best.device)
    p = probs[rows, best]  # [B, V]
    # rejection's residual: every child of the last accepted node was tried and rejected
    tried = candidate & (parents == best[:, None]) & ~typical[:, None]
    residual = p * (torch.zeros_like(p).scatter_add(1, tokens, tried.to(p.dtype)) == 0)
    p = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)  # (rounding may leave a tried token all the mass)
    return outcome(best, sample(p, draws[:, 0]), depths, chains)


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 filters: bool) -> torch.Tensor:
    """acceptance.target_probs per row: logits [B, T, V], temperature, top_k (0: none), top_p [B] -> p [B, T, V]
    in float32 (top-k keeps exactly k tokens, ties by the sort)."""
    greedy = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    scaled = logits.float() / temperature.clamp_min(1e-6)[:, None, None]  # (a greedy row's is not used)
    if filters:
        values, order = scaled.sort(-1, descending=True)
        rank = torch.arange(logits.shape[-1], device=logits.device)
        values = values.masked_fill((top_k[:, None, None] > 0) & (rank >= top_k[:, None, None]), float("-inf"))
        ranked = values.softmax(-1)
        ranked = ranked.masked_fill(ranked.cumsum(-1) - ranked >= top_p[:, None, None], 0)  # keeps the top token
        probs = torch.zeros_like(ranked).scatter(-1, order, ranked / ranked.sum(-1, keepdim=True))
    else:
        probs = scaled.softmax(-1)
    return torch.where((temperature == 0)[:, None, None], greedy, probs)


def sample(p: torch.Tensor, draw: torch.Tensor) -> torch.Tensor:
    """p [B, V] (not normalised), draw [B] uniform in [0, 1) -> [B] a token of p, by its inverse cumulative
    distribution; never one of no mass."""
    total = p.cumsum(-1)
    token = torch.searchsorted(total, (draw * total[:, -1])[:, None], right=True)[:, 0]
    last = ((p > 0) * torch.arange(p.shape[-1], device=p.device)).argmax(-1)  # where rounding reaches the end
    return torch.minimum(token, last)


def mix(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors of 32-bit words (each product split in 16-bit halves, so
    nothing overflows)."""
    for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        x = x ^ (x >> shift)
        x = (x * (factor & 0xFFFF) + (((x * (factor >> 16)) & 0xFFFF) << 16)) & MASK
    return x ^ (x >> 16)


def uniforms(key: torch.Tensor, counter: torch.Tensor, n: int) -> torch.Tensor:
    """key, counter [B] -> [B, n] independent uniform draws in [0, 1), 24 bits each: a function of its arguments
    alone (a row's length is its counter: it grows every step)."""
    index = torch.arange(n, device=key.device)
    h = mix(mix(mix(index + 0x9E3779B9)[None, :] ^ (counter[:, None] & MASK)) ^ (key[:, None] & MASK))
    return (h >> 8).float() / (1 << 24)


def draw_key(generator: torch.Generator | None) -> int:
    """A sampled row's key, from its generator (torch's default one where it has none)."""
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(1 << 32, (1,), generator=generator, device=device))
