"""The compiled engine: fixed-shape steps decode what the eager engine decodes, token for token, with one graph per
tree size whatever the prompt, context length or budget; its acceptance and path moves on the device equal the eager
ones. (Rejection sampling through it: test_sampling.)"""

import copy

import pytest
import torch
from conftest import FAMILIES, needs_compiler
from engine_helpers import (
    OracleHeads,
    decode,
    greedy_reference,
    lively_model,
    on_compiled_engine,
    random_heads,
    verify,
)

from medusa_decoding import cache as kv
from medusa_decoding import compiled, device_acceptance
from medusa_decoding.acceptance import greedy
from medusa_decoding.candidates import confident_tree
from medusa_decoding.compiled import Compiled
from medusa_decoding.config import DEFAULT_TREE, GenerationConfig
from medusa_decoding.decoding import PLAIN, Batch, Row
from medusa_decoding.eager import Eager, prefill
from medusa_decoding.guard import Ladder
from medusa_decoding.heads_draft import guess, guess_confident
from medusa_decoding.tree import Tree, padded

PROMPT = torch.tensor([17, 3, 88, 41, 5, 60, 29, 72, 11, 94, 38, 50])
# three static trees and a confident one (its nodes chosen each step, in its step's graph: candidates.confident_tree)
TREES = (PLAIN, Tree.from_spec([2, 1]), Tree.from_spec(DEFAULT_TREE), Ladder.fixed(Tree.from_spec(DEFAULT_TREE), True))
DEVICE_STEPS = 4  # one graph per tree (compiled.device_graph)
CANDIDATE_GRAPHS = 2  # the static trees with candidates: their first step's candidates (a confident one's: eagerly)

pytestmark = [pytest.mark.usefixtures("one_thread"), needs_compiler]  # every test here compiles, or checks a graph


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def tokens_of(model, heads, prompt, tree, new_tokens, eager=False):
    steps = decode(model, heads, prompt, GenerationConfig(max_new_tokens=new_tokens), tree, compiled=not eager)
    return [t for step, _ in steps for t in step]


@needs_compiler
def test_compiled_engine_decodes_as_generate_with_one_graph_per_tree_size(family):
    model = lively_model(family, seed=FAMILIES.index(family))
    engine = on_compiled_engine(copy.deepcopy(model))
    # the oracle's paths are accepted deep and cut at every depth: the moves and the greedy rule see real work
    # (the two oracles' tables of the same size: a compiled step runs the heads inside its graph)
    long_prompt, new_tokens = PROMPT.repeat(3), (40, 16)
    references = [greedy_reference(model, prompt, n) for prompt, n in zip((PROMPT, long_prompt), new_tokens)]
    heads = [OracleHeads(engine, torch.cat([prompt, torch.tensor(reference)]))
             for prompt, reference in zip((PROMPT, long_prompt), references)]
    before = graphs()
    for tree in TREES:
        assert tokens_of(engine, heads[0], PROMPT, tree, new_tokens[0]) == references[0]
    first = graphs() - before
    # a device step per tree and a candidates graph for each static one's first step (fewer where a model of the same
    # shapes compiled them: the candidates graphs are per heads, not per model)
    assert DEVICE_STEPS <= first <= DEVICE_STEPS + CANDIDATE_GRAPHS
    for tree in TREES:  # another prompt, context and budget (the last steps' trees cut short): no new graph
        assert tokens_of(engine, heads[1], long_prompt, tree, new_tokens[1]) == references[1]
    assert graphs() - before == first
    assert tokens_of(engine, heads[0], PROMPT, TREES[2], new_tokens[0], eager=True) == references[0]


@needs_compiler
# fused: the graph gives layer 1's output too; hydra: each row's candidates graph reads its own path; confident: each
# row's tree chosen in the step's graph
@pytest.mark.parametrize("kind, layers, confident", [("medusa", (), False), ("medusa", (1,), False),
                                                     ("hydra", (), False), ("hydra", (), True)],
                         ids=["medusa", "fused", "hydra", "hydra confident"])
def test_compiled_batch_decodes_each_row_as_alone(kind, layers, confident):
    model = lively_model("qwen2")
    engine = on_compiled_engine(copy.deepcopy(model))
    prompts = (PROMPT, PROMPT[:5], PROMPT.repeat(2))  # rows of different lengths: placed writes, masked holes
    budgets = (30, 12, 21)  # rows leave at different steps
    batch = Batch(engine, random_heads(engine, feature_layers=layers, kind=kind), compiled=True)
    tree = Ladder.fixed(Tree.from_spec([2, 1]), confident)
    rows = [batch.join(prompt, GenerationConfig(max_new_tokens=n), tree) for prompt, n in zip(prompts, budgets)]
    produced = {id(row): [row.root] for row in rows}
    while batch.rows:
        for row, new, _ in batch.step():
            produced[id(row)] += new
    assert [produced[id(row)] for row in rows] == [greedy_reference(model, p, n) for p, n in zip(prompts, budgets)]


@needs_compiler
def test_a_greedy_row_beside_sampled_rows_on_the_device_decodes_as_alone(monkeypatch):
    """A batch's rows greedy and sampled (rejection with top-k, typical) in one device step (device_acceptance's
    rules, per row): the greedy row decodes as generate, and no step goes through the host."""
    model = lively_model("llama", seed=1)
    engine = on_compiled_engine(copy.deepcopy(model))
    reference = greedy_reference(model, PROMPT, 24)
    heads = OracleHeads(engine, torch.cat([PROMPT, torch.tensor(reference)]))
    monkeypatch.setattr(Compiled, "verify", None)  # the host's step: not taken
    batch, tree = Batch(engine, heads, compiled=True), Tree.from_spec([2, 2, 1])
    greedy = batch.join(PROMPT, GenerationConfig(max_new_tokens=24), tree)
    for n, fields in ((5, {"top_k": 3}), (8, {"acceptance": "typical"})):
        batch.join(PROMPT[:n], GenerationConfig(max_new_tokens=20, temperature=0.9, **fields), tree,
                   generator=torch.Generator().manual_seed(n))
    produced, taken = [greedy.root], 0
    while greedy in batch.rows:
        produced += next(new for row, new, _ in batch.step() if row is greedy)
        taken += 1
    assert produced == reference and taken < 16  # the oracle's paths accepted deep


@needs_compiler
def test_confident_steps_leave_the_tree_they_are_shaped_like_as_it_was():
    """A confident step writes each step's tree over its buffers, which start as tree.padded's tensors of its shape
    (tree.spanning: here the chain of 2, a tree any request may verify): they must be copies, not those cached
    tensors (they were: the chain's later requests verified the last confident tree's mask)."""
    model = on_compiled_engine(lively_model("llama"))
    heads, chain = random_heads(model), Tree.from_spec([1, 1])
    before = [t.clone() for t in padded(chain, chain.num_nodes, torch.device("cpu"))]
    tokens_of(model, heads, PROMPT, Ladder.fixed(Tree.from_spec([2]), True), 12)
    assert all(torch.equal(a, b) for a, b in zip(before, padded(chain, chain.num_nodes, torch.device("cpu"))))


@needs_compiler
def test_steps_run_ahead_decode_as_steps_in_turn_as_rows_join_leave_and_windows_widen():
    """Device steps launched one ahead of the host against steps in turn, both attending windows (as on a GPU): a row
    joins while a step runs ahead, rows leave at different steps (the step run ahead for them dropped, the others'
    state given back: the first row's oracle heads, which find their place by that state, accept as deep), and a long
    row's steps move to a wider attended window (kv.attend) and grow the cache. Each row decodes what it decodes
    alone, step for step."""
    model = lively_model("llama", seed=2)
    engine = on_compiled_engine(copy.deepcopy(model))
    prompts, budgets = (PROMPT, PROMPT[:5], PROMPT.repeat(21)), (30, 9, 40)  # 252 + 40 tokens: past 256 columns
    references = [greedy_reference(model, p, n) for p, n in zip(prompts, budgets)]
    heads = OracleHeads(engine, torch.cat([PROMPT, torch.tensor(references[0])]))

    def run(ahead: bool) -> tuple[list, set]:
        batch = Batch(engine, heads, compiled=True)
        batch.engine.ahead, batch.engine.windowed, batch.engine.prefill_chunk = ahead, True, 16
        join = lambda i: batch.join(prompts[i], GenerationConfig(max_new_tokens=budgets[i]), Tree.from_spec([2, 1]))
        rows = [join(0), join(1)]
        produced, windows = {id(row): [[row.root]] for row in rows}, set()
        while batch.rows:
            for row, new, _ in batch.step():
                produced[id(row)].append(new)
            windows.add(batch.cache.layers[0].window)
            if len(produced[id(rows[0])]) == 4:
                kv.reserve(batch.cache, 3, 2048 + 1)  # capacity doubles under the steps: their entries move with it
                rows.append(join(2))
                produced[id(rows[2])] = [[rows[2].root]]
        return [produced[id(row)] for row in rows], windows

    alone, windows = run(ahead=False)
    assert windows == {256, 512}  # an eighth of the capacity, then of the grown one (which the next batch reuses)
    assert run(ahead=True)[0] == alone
    assert [[t for step in steps for t in step] for steps in alone] == references
    assert len(alone[0]) < 20  # the oracle's paths accepted deep


@needs_compiler
def test_a_prefill_in_passes_of_a_few_tokens_gives_what_a_whole_one_does(family):
    """Compiled.prefill in passes of a few tokens (as on a GPU) against the eager prefill: a prompt shorter than a
    pass, one that fills two exactly, one whose last pass overlaps the one before, then a short one again (the kept
    one-row cache holds the long one's entries past it): the same logits, heads' input state and cache entries; the
    graph of a pass has no break (with heads that read a layer's output, which transformers records through hooks
    that it installs at the first pass asking for them)."""
    model = on_compiled_engine(lively_model(family))
    engine = Compiled(model, random_heads(model, feature_layers=(1,)))
    engine.prefill_chunk = 8
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    for prompt in (PROMPT[:5], PROMPT.repeat(2)[:16], PROMPT.repeat(2)[:21], PROMPT[:3]):
        with torch.inference_mode():  # as Batch.join runs it
            cache, logits, state = engine.prefill(prompt)
            want_cache, want_logits, want_state = prefill(model, prompt, len(prompt), engine.layers)
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(state, want_state, atol=1e-4, rtol=1e-4)
        for layer, want in zip(cache.layers, want_cache.layers):
            torch.testing.assert_close(layer.keys, want.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(layer.values, want.values, atol=1e-4, rtol=1e-4)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks


@needs_compiler
@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_the_candidates_graph_guesses_what_the_eager_candidates_do(kind):
    """The compiled engine's candidates (one graph per heads and tree) against candidates.candidates run eagerly: the
    same tokens and guesses for the whole tree and for a subtree of it, and no guesses where the guard reads none.
    (Random heads over a tiny vocabulary: their ranks lie apart by far more than the graph's rounding.)"""
    model = lively_model("llama")
    heads, lm_head, embed = random_heads(model, kind=kind), model.get_output_embeddings(), model.get_input_embeddings()
    hidden = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for spec in ([3, 2, 2], [[0], [1], [1, 0], [1, 1], [1, 1, 0]]):
            tree = Tree.from_spec(spec)
            small = tree.truncated(1)
            for sub in (tree, small):
                eager, on_graph = (guess(heads, lm_head, embed, hidden, 7, sub, tree, run=engine.candidates)
                                   for engine in (Eager(model, heads), Compiled(model, heads)))
                assert torch.equal(eager[0], on_graph[0]) and eager[0][0] == 7
                assert (torch.equal(eager[1], on_graph[1]) if kind == "medusa" else eager[1] == on_graph[1])
            assert guess(heads, lm_head, embed, hidden, 7, tree, tree, run=Compiled(model, heads).candidates,
                         keep=False)[1] is None


@pytest.mark.parametrize("spec", [DEFAULT_TREE, [3, 2, 2], [[0], [1], [1, 0], [1, 1], [1, 1, 0]]])
def test_device_greedy_acceptance_equals_the_eager_rule(spec):
    tree, generator = Tree.from_spec(spec), torch.Generator().manual_seed(0)
    rows, nodes = 64, tree.num_nodes + 3  # padded, as in a batch with a larger tree
    depths, parents, attention, chains = (torch.stack([t] * rows) for t in padded(tree, nodes, torch.device("cpu")))
    argmax = torch.randint(0, 4, (rows, nodes), generator=generator)  # 4 tokens: many accepted, at every depth
    # siblings hold distinct tokens (ranks of one top-k), so at most one of them is the argmax
    ranks = torch.cat([torch.zeros(1, dtype=torch.long), tree.ranks, torch.zeros(3, dtype=torch.long)])
    tokens = (torch.randint(0, 4, (rows, nodes), generator=generator).gather(1, parents) + ranks) % 4
    got = device_acceptance.accept_greedy(tokens, argmax, depths, parents, attention, chains).tolist()
    lengths = set()
    for b in range(rows):
        logits = torch.nn.functional.one_hot(argmax[b, : tree.num_nodes], 4).float()
        path, root = greedy(tokens[b, : tree.num_nodes], logits, tree, GenerationConfig())
        count = got[b][0]
        assert (got[b][2 : 2 + count], got[b][1]) == (path.tolist(), root)
        assert got[b][2 + count :] == list(range(count, nodes))  # the padding moves nothing
        lengths.add(count)
    assert len(lengths) >= 3


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_the_confident_tree_in_tensors_is_the_one_the_host_chooses(kind):
    """candidates.confident_tree (fixed shapes, a batch: what a compiled step runs) against heads_draft.guess_confident
    (one row, on the host): the same candidates on the same paths (read through the tree tensors' chains), for trees
    smaller and larger than the heads' depth."""
    model = lively_model("llama")
    heads, lm_head, embed = random_heads(model, kind=kind), model.get_output_embeddings(), model.get_input_embeddings()
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(5)) * 3
    roots = torch.tensor([5, 9, 11])

    def paths(tokens: torch.Tensor, depths: torch.Tensor, chains: torch.Tensor) -> list[tuple[int, ...]]:
        return sorted(tuple(tokens[chains[i, : depths[i] + 1]].tolist()) for i in range(len(tokens)))

    with torch.no_grad():
        for size in (1, 3, 8, 20):
            tokens, (depths, _, _, chains) = confident_tree(heads, lm_head, embed, hidden, roots, size)
            for b in range(len(roots)):
                tree, expected, _ = guess_confident(heads, lm_head, embed, hidden[b], int(roots[b]), size, size)
                host_depths, _, _, host_chains = padded(tree, size + 1, roots.device)
                assert tree.num_nodes == size + 1
                assert paths(tokens[b], depths[b], chains[b]) == paths(expected, host_depths, host_chains)


def test_gather_paths_moves_what_commit_moves(family):
    model, tree = lively_model(family), Tree.from_spec(DEFAULT_TREE)
    tokens = torch.randint(0, 96, (tree.num_nodes,), generator=torch.Generator().manual_seed(1))
    paths = ([0], [0, 1, 4, 7, 8], [0, 2, 6], [0, 3])  # DEFAULT_TREE's nodes: 6 is (1, 0), 3 (2,)
    with torch.no_grad():
        caches = []
        for _ in range(2):  # whole caches, as the compiled engine's (gather_paths moves over their stacked buffers)
            cache = kv.allocate(model, len(PROMPT) + tree.num_nodes, whole=True)
            kv.insert(cache, prefill(model, PROMPT, len(PROMPT))[0], len(PROMPT) + tree.num_nodes)
            verify(model, cache, tokens, tree, len(PROMPT))
            caches.append(cache)
        for path in paths:  # the same pass committed both ways, one path after another
            kv.commit(caches[0], [len(PROMPT)], [path])
            moves = torch.tensor([path + list(range(len(path), tree.num_nodes))])
            kv.gather_paths(caches[1], torch.tensor([len(PROMPT)]), moves)
            end = len(PROMPT) + len(path)
            for mine, theirs in zip(caches[1].layers, caches[0].layers, strict=True):
                assert torch.equal(mine.key_buffer[:, :, :end], theirs.key_buffer[:, :, :end])
                assert torch.equal(mine.value_buffer[:, :, :end], theirs.value_buffer[:, :, :end])


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_step_graph_settings_are_valid_on_every_device(device_type):
    """torch.compile refuses a mode and options together; the step graph's own options (no module guards) join the
    device's settings, so each device's must come as options alone. Built here, not run: no GPU is needed."""
    class Model:
        device = torch.device(device_type)

    assert callable(compiled.model_graph(compiled.verify_graph, Model()))
    assert callable(compiled.model_graph(compiled.device_graph, Model(), True, **{"triton.cudagraphs": False}))
    assert callable(compiled.graph(kv.gather_paths, device_type))


class HostReads:
    """Counts the reads of tensor values by the host (tolist, item, bool, int, float, index) while entered: the
    methods themselves are wrapped (a TorchFunctionMode would do it too, but dynamo guards on modes and compiles
    every graph again under one)."""

    READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        self.monkeypatch, self.count = monkeypatch, 0

    def __enter__(self):
        for name in self.READS:
            self.monkeypatch.setattr(torch.Tensor, name, self.counting(getattr(torch.Tensor, name)))
        return self

    def __exit__(self, *exc):
        self.monkeypatch.undo()

    def counting(self, read):
        def counted(tensor, *args, **kwargs):
            self.count += 1
            return read(tensor, *args, **kwargs)
        return counted


@needs_compiler
@pytest.mark.parametrize("tree, sampling", [
    (PLAIN, {}), (Tree.from_spec([2, 1]), {}), (Tree.from_spec([2, 1]), {"temperature": 0.8, "top_p": 0.9}),
    (Ladder.fixed(Tree.from_spec([2, 1]), True), {}), (Ladder.fixed(Tree.from_spec([2, 1]), True), {"temperature": 1})],
    ids=["plain", "tree", "sampled tree", "confident tree", "sampled confident tree"])
def test_a_compiled_step_reads_the_device_once_and_a_second_request_compiles_nothing(tree, sampling, monkeypatch):
    """Batch.step on the compiled engine under a fixed or confident tree, greedy or sampled (device_acceptance),
    launched one ahead over windows (as on a GPU): one graph (compiled whole: fullgraph), one read of the device a
    step, counted where the engine routes its reads (compiled.read) and at every tensor method that reads values; a
    second request, at another context length, compiles nothing new."""
    model = on_compiled_engine(lively_model("llama"))
    heads = random_heads(model)
    config = GenerationConfig(max_new_tokens=16, **sampling)

    def request(prompt: torch.Tensor, each_step=lambda: None) -> Row:
        batch = Batch(model, heads, compiled=True)
        batch.engine.ahead, batch.engine.windowed, batch.engine.prefill_chunk = True, True, 8
        row = batch.join(prompt, config, tree)
        with torch.inference_mode():
            batch.step()  # the first step builds the rows' device state
            while batch.rows:
                each_step()
                batch.step()
        return row

    assert request(PROMPT).produced == 16
    before, breaks, routed = graphs(), sum(torch._dynamo.utils.counters["graph_break"].values()), compiled.host_reads
    reads = []  # compiled.host_reads before each step
    row = request(PROMPT[:7], lambda: reads.append(compiled.host_reads))
    assert len(reads) >= 3 and compiled.host_reads - routed == len(reads) + 1 and row.produced == 16
    assert [b - a for a, b in zip(reads, reads[1:])] == [1] * (len(reads) - 1)
    assert graphs() == before and sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks
    with HostReads(monkeypatch) as reads:
        counts = []
        request(PROMPT[:9], lambda: counts.append(reads.count))
    assert len(counts) >= 3 and [b - a for a, b in zip(counts, counts[1:])] == [1] * (len(counts) - 1)
    assert graphs() == before
