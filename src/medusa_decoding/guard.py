"""`--tree auto` at run time: each step, the tree of a calibrated ladder that pays most on this prompt, down to
plain one-token steps.

Calibration (calibrate.py) predicts, for the best tree of each size (0: plain decoding), the tokens a step yields
(from the heads' accuracy on its data) and the step's latency at several context lengths (on the kernels that
run). A prompt unlike the calibration data (code, another language) makes the first prediction wrong, the machine
of the moment the second: the guard corrects both from what the running request shows, and before each step
picks the tree with the most expected tokens per second.

- A request opens with plain steps in which the heads guess, until OPENING steps' yields are counted: its own
  yields, not the calibration's alone, pick its first tree (on a prompt the heads cannot guess, a tree predicted
  from the calibration ran for many steps before its yields showed).
- Tokens per step, of every tree at once: a step's guesses (each head's top-k) are kept until the tokens they
  guessed are known. Those tokens are the same whichever tree verifies them (exactly at temperature 0; when
  sampling, in distribution: rejection sampling accepts a set of siblings with the probability that the drawn
  token is one of them), so the guesses tell how many tokens each tree of the ladder would have yielded at that
  step, without running it. The calibration's prediction counts as PRIOR_WEIGHT such steps; the last ~8 steps
  weigh most. While decoding plainly the heads still guess, every PROBE_EVERY-th step, so that the guard sees
  when they are worth it again.
- Step time: each step's measured time against its tree's calibrated latency at its context, weighed as the
  tokens are; not the first step of a request (it carries one-off costs that the steps after it do not), nor a
  plain step in which the heads guess (plain steps would seem that much dearer). A tree not timed (or not lately)
  is expected to keep its calibrated ratio to the one running; and while trees run, every EXPLORE_EVERY-th step is a
  plain one where plain is within reach, so that the baseline they must beat is timed in this very request.

In a batch (decoding.Batch) the rows share each forward pass, padded to its largest tree: one row's tree costs every
row its size, so a tree pays for the whole batch or for none of its rows. The rows under one ladder pick together
(`batch_yields`): their mean yields against the latency of a step of the whole batch with each tree (calibrate times
steps at several batch sizes), so as the batch grows speculation has to pay for more rows and the batch moves to
smaller trees, down to plain steps. Steps of a batch are not timed (their time is every row's).

Another tree is taken only when predicted SWITCH_MARGIN faster: the calibrated latencies of neighbouring sizes differ
by little and vary from run to run, and a few steps' yields are noisy.

Every step is verified as before: greedy output is identical whatever the guard picks. A sampled request with a seed
is not timed (its guard follows the tokens and the calibrated latencies): rejection sampling draws differently over
different trees, and the seed must repeat the run.
"""

from collections import deque
from dataclasses import dataclass

import torch

from .tree import Tree

SMOOTHING = 1 / 8  # weight of a new observation in the running estimates: they follow about the last 8 steps
PRIOR_WEIGHT = 2  # what the calibration predicts counts as this many steps (a running mean, until SMOOTHING)
FADING = SMOOTHING / 4  # how fast what was seen of a tree's step time fades while another tree runs
OPENING = 3  # a request's first steps are plain and guess, until this many steps' yields are counted: its own ...
PROBE_EVERY = 8  # while decoding plainly, the heads guess every this many steps (a guess: a small part of a step)
EXPLORE_EVERY = 32  # while trees run, every this many steps is a plain one, timed (little lost where trees win) ...
EXPLORE_BELOW = 1.15  # ... where plain is predicted within this factor of the tree: beyond, no timing changes a pick
SWITCH_MARGIN = 1.03  # another tree is taken when predicted this much faster: less is within the estimates' noise
TIME_CLIP = 2.0  # a step's time counts at most this factor away from its tree's estimate (a preempted step)


@dataclass(frozen=True)
class Ladder:
    """The trees the guard chooses among, smallest first, each holding the nodes of those before it, and what the
    calibration predicts of them. expected_tokens[i]: tokens per step of trees[i]; latency_s[c][i]: its step
    seconds at contexts[c] tokens (increasing).

    >>> Ladder.fixed(Tree.from_spec([[0], [1]])).latency(300)   # an explicit tree: nothing to choose
    [1.0]
    """

    trees: tuple[Tree, ...]
    expected_tokens: tuple[float, ...]
    contexts: tuple[int, ...]
    latency_s: tuple[tuple[float, ...], ...]
    batch_sizes: tuple[int, ...] = (1,)  # batches whose step latency was measured (calibrate), increasing from 1
    batch_latency_s: tuple[tuple[float, ...], ...] | None = None  # [batch_sizes][trees] a whole batch's step seconds
    # confidence-driven: a tree stands for its size only, each step's candidates are the likeliest that many under the
    # heads' own probabilities (heads_draft.guess_confident); its calibrated yields, the fixed tree's, are a floor
    confident: bool = False
    guarded: bool = False  # watched by the guard even alone (Ladder.fixed)

    def __post_init__(self):
        n = len(self.trees)
        if not n or len(self.expected_tokens) != n:
            raise ValueError(f"ladder: {n} trees, {len(self.expected_tokens)} expected yields")
        if list(self.contexts) != sorted(set(self.contexts)) or len(self.latency_s) != len(self.contexts):
            raise ValueError(f"ladder: contexts must increase, one latency row each, got {list(self.contexts)}")
        if any(len(row) != n or min(row) <= 0 for row in self.latency_s):
            raise ValueError("ladder: a positive step latency for every tree at every context")
        for smaller, larger in zip(self.trees, self.trees[1:]):
            if not set(smaller.paths) <= set(larger.paths):
                raise ValueError("ladder: every tree must hold the nodes of the smaller ones")
        if self.batch_latency_s is not None and (
                self.batch_sizes[0] != 1 or list(self.batch_sizes) != sorted(set(self.batch_sizes))
                or len(self.batch_latency_s) != len(self.batch_sizes)
                or any(len(row) != n or min(row) <= 0 for row in self.batch_latency_s)):
            raise ValueError("ladder: batch sizes 1 < b2 < ..., a positive batch step latency for every tree at each")

    @staticmethod
    def fixed(tree: Tree, confident: bool = False, tokens: float = 1.0, guarded: bool = False) -> "Ladder":
        """One tree, always: an explicit tree, or plain decoding (confident: its size, the likeliest nodes; tokens:
        what such a step yields, where the calibration says). guarded: a guard watches it as it watches a ladder's
        pick (on the compiled engine, the host's path: what warm_up compiles for each)."""
        return Ladder((tree,), (tokens,), (0,), ((1.0,),), confident=confident, guarded=guarded)

    @property
    def tree(self) -> Tree:
        """The largest: calibration's pick (the one tree of a fixed ladder)."""
        return self.trees[-1]

    def latency(self, context: int, batch: int = 1) -> list[float]:
        """Step seconds of every tree at `context` tokens in a batch of `batch` rows: the one-row latency at that
        context, times what the batch's step costs against one row's with that tree (measured at one context)."""
        one = interpolate(self.contexts, self.latency_s, context)
        if batch == 1 or self.batch_latency_s is None:
            return one
        at_batch = interpolate(self.batch_sizes, self.batch_latency_s, batch)
        scale = [b / a for a, b in zip(self.batch_latency_s[0], at_batch)]
        return [seconds * factor for seconds, factor in zip(one, scale)]


def running(estimate: float, observed: float, count: int, prior_weight: float, smoothing: float) -> float:
    """A running estimate moved toward its `count`-th observation: a mean in which the prior counts as `prior_weight`
    observations, until a new one's weight falls to `smoothing`; then an average over about the last 1 / smoothing.

    >>> running(1.0, 0.0, 1, 2, 1 / 8), running(1.0, 0.0, 100, 2, 1 / 8)
    (0.6666666666666667, 0.875)
    """
    return estimate + max(1 / (prior_weight + count), smoothing) * (observed - estimate)


def interpolate(at: tuple[int, ...], rows: tuple[tuple[float, ...], ...], x: float) -> list[float]:
    """rows[i] holds at at[i] (increasing): the row at x, linear between, flat beyond."""
    if x <= at[0] or len(at) == 1:
        return list(rows[0])
    if x >= at[-1]:
        return list(rows[-1])
    c = next(c for c in range(1, len(at)) if at[c] >= x)
    w = (x - at[c - 1]) / (at[c] - at[c - 1])
    return [a + w * (b - a) for a, b in zip(rows[c - 1], rows[c])]


class Guard:
    """One request's tree for each step. With a fixed ladder it always picks that tree and watches nothing."""

    def __init__(self, ladder: Ladder, root: int):
        trees = ladder.trees
        self.ladder, self.choice = ladder, 0
        self.watching = len(trees) > 1 or ladder.guarded
        self.depth = max(tree.depth for tree in trees)
        # the largest holds every node: its guesses cover every tree (None: the root alone, nothing to guess)
        self.watched = ladder.tree if ladder.tree.num_nodes > 1 else None
        self.tokens = list(ladder.expected_tokens)  # expected tokens per step, per tree
        self.observed = 0  # steps whose yields were counted
        self.time_factor: list[float | None] = [None] * len(trees)  # measured / calibrated step time, per tree
        self.timed = [0] * len(trees)  # steps timed, per tree
        self.first: dict[tuple[int, ...], int] = {}  # node path -> the first tree that holds it
        for index, tree in enumerate(trees):
            for path in tree.paths:
                self.first.setdefault(path, index)
        self.sizes = [tree.num_nodes - 1 for tree in trees]
        self.generated = [root]
        # (where the guessed tokens start, guesses, the first tree holding each node: a confident step's own)
        self.pending: deque[tuple[int, list[list[int]] | dict, dict | None]] = deque()
        self.plain_steps = self.tree_steps = 0
        self.explores = trees[0].num_nodes == 1  # a ladder from plain decoding up times plain steps too
        self.opening = OPENING + self.depth  # ... yields pick its first tree (a step's are known `depth` steps later)

    def choose(self, context: int, batch: int = 1, pooled: list[float] | None = None) -> tuple[Tree, Tree | None]:
        """The tree of the next step at `context` tokens in a batch of `batch` rows, and the tree the heads guess for in
        it (heads_draft.guess): the ladder's largest, which covers every tree, or None (a plain step that does not
        probe). pooled: the batch's mean yields per tree (`batch_yields`), which every row of the batch then follows
        as they stand."""
        if not self.watching:
            return self.ladder.tree, self.watched
        if self.plain_steps + self.tree_steps < self.opening:  # the smallest tree (plain, from calibrate), guessing
            self.plain_steps += 1
            return self.ladder.trees[0], self.watched
        latency = self.ladder.latency(context, batch)
        if pooled is not None:  # the batch's calibrated step times: a row's own timings were taken alone
            speed = [tokens / seconds for tokens, seconds in zip(pooled, latency)]
        else:
            seen = self.time_factor[self.choice] or 1.0  # trees not timed yet: their calibrated latency ratio
            speed = [tokens / ((factor or seen) * seconds)
                     for tokens, factor, seconds in zip(self.tokens, self.time_factor, latency)]
        best = max(range(len(speed)), key=speed.__getitem__)
        # noise in the estimates must not flip trees; a batch's rows follow its pick as one, or pad to another's tree
        if pooled is not None or speed[best] > SWITCH_MARGIN * speed[self.choice]:
            self.choice = best
        tree = self.ladder.trees[self.choice]
        if tree.num_nodes == 1:
            self.plain_steps += 1
            return tree, self.watched if self.plain_steps % PROBE_EVERY == 0 else None
        self.tree_steps += 1
        if (self.explores and batch == 1 and self.tree_steps % EXPLORE_EVERY == 0
                and speed[self.choice] < EXPLORE_BELOW * speed[0]):
            self.choice = 0  # plain is within reach: time it (no guesses in it)
            return self.ladder.trees[0], None
        return tree, self.watched

    def expected(self) -> float:
        """Tokens a step of the tree in use is expected to yield."""
        return self.tokens[self.choice]

    def record(self, guesses: torch.Tensor | dict | tuple | None, new: list[int], seconds: float | None, context: int
               ) -> None:
        """After a step: its guesses (heads_draft.guess's, or None), the tokens it produced, its seconds (None:
        not the ladder's tree, as one cut at the token budget's end) and the context it started at."""
        if not self.watching:
            return
        if isinstance(guesses, tuple):  # a confident step: trees of each size hold its likeliest nodes
            tops, ranked = guesses
            self.pending.append((len(self.generated), tops, first_sizes(ranked, self.sizes)))
        elif guesses is not None:
            self.pending.append((len(self.generated), guesses if isinstance(guesses, dict) else guesses.tolist(), None))
        self.generated += new
        while self.pending and self.pending[0][0] + self.depth <= len(self.generated):
            self.count_tokens(*self.pending.popleft())
        first = self.plain_steps + self.tree_steps == 1
        probe = guesses is not None and self.ladder.trees[self.choice].num_nodes == 1
        if seconds is not None and not first and not probe:
            self.time_step(seconds / self.ladder.latency(context)[self.choice])

    def count_tokens(self, start: int, guesses: list[list[int]] | dict, first: dict | None = None) -> None:
        """Updates each tree's tokens per step with what it would have yielded at the step whose guesses were for
        generated[start:] (first: that step's own first tree of each node, else the ladder's)."""
        self.observed += 1
        for i, tokens in enumerate(yields(guesses, self.generated[start:], first or self.first, len(self.tokens))):
            self.tokens[i] = running(self.tokens[i], tokens, self.observed, PRIOR_WEIGHT, SMOOTHING)

    def time_step(self, ratio: float) -> None:
        """A step of the chosen tree took `ratio` times its calibrated latency; what was seen of others fades."""
        factors, i = self.time_factor, self.choice
        known = [factor for factor in factors if factor is not None]
        reference = factors[i] or (sum(known) / len(known) if known else ratio)  # untimed: the others' ratio
        self.timed[i] += 1
        clipped = min(max(ratio, reference / TIME_CLIP), reference * TIME_CLIP)
        factors[i] = running(reference, clipped, self.timed[i], PRIOR_WEIGHT, SMOOTHING) if known else ratio
        for j, factor in enumerate(factors):
            if j != i and factor is not None:
                factors[j] = factor + FADING * (factors[i] - factor)


def batch_yields(guards: list[Guard]) -> list[list[float] | None]:
    """Per guard, the mean tokens per step of each tree over the watching guards of its batch under the same ladder
    (None: a fixed ladder, or alone on its ladder): what the batch's step yields per row with that tree."""
    groups: dict[int, list[Guard]] = {}
    for guard in guards:
        if guard.watching:
            groups.setdefault(id(guard.ladder), []).append(guard)
    means = {key: [sum(column) / len(group) for column in zip(*(guard.tokens for guard in group))]
             for key, group in groups.items() if len(group) > 1}
    return [means.get(id(guard.ladder)) if guard.watching else None for guard in guards]


def first_sizes(ranked: list[tuple[int, ...]], sizes: list[int]) -> dict[tuple[int, ...], int]:
    """Node paths, likeliest first (a confident step's, or calibration's greedy order), and nested tree sizes -> each
    path's first tree: the index of the smallest size that holds it (a tree of n candidates holds the n first).

    >>> first_sizes([(0,), (1,), (0, 0)], [0, 1, 3])
    {(0,): 1, (1,): 2, (0, 0): 2}
    """
    return {path: next(i for i, n in enumerate(sizes) if n > rank) for rank, path in enumerate(ranked[: sizes[-1]])}


def yields(guesses: list[list[int]] | dict, tokens: list[int], first: dict[tuple[int, ...], int], trees: int
           ) -> list[int]:
    """The tokens each of `trees` nested trees yields at a step: guesses [depth][k] (each head's top-k, MEDUSA) or
    {node path: the top-k after that node} (hydra), tokens the ones that followed the root, first[path] the first
    tree holding that node. Greedy verification accepts the longest path of right guesses a tree holds, and adds
    one token of its own.

    >>> yields([[7, 8], [5, 9]], [8, 5], {(0,): 0, (1,): 1, (1, 0): 2}, 3)   # (1,) right, then (1, 0)
    [1, 2, 3]
    >>> yields({(): [7, 8], (1,): [9, 5]}, [8, 5], {(0,): 0, (1,): 1, (1, 1): 2}, 3)   # hydra: (1,), then (1, 1)
    [1, 2, 3]
    """
    depths, node = [], ()  # along the guesses right in a row: the first tree holding each node
    for depth, token in enumerate(tokens):
        guessed = guesses.get(node) if isinstance(guesses, dict) else guesses[depth] if depth < len(guesses) else None
        if guessed is None or token not in guessed or (node := node + (guessed.index(token),)) not in first:
            break
        depths.append(first[node])
    return [1 + sum(tree >= depth for depth in depths) for tree in range(trees)]
