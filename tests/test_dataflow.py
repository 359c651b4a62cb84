"""Dead code in a recomputation below the layer (``planning/dataflow.py``): what a block's
recomputation need not run, found from its forward's dataflow and what autograd saved; and
the engine's guard when a recomputation runs differently than its forward."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from cswap_lightning.core import selective
from cswap_lightning.core.selective import Region
from cswap_lightning.planning import ops
from cswap_lightning.planning.dataflow import WEIGHTS, Dataflow
from cswap_lightning.planning.trace import trace

aten = torch.ops.aten


class Recorded(torch.utils._python_dispatch.TorchDispatchMode):
    """Records a function's calls into a Dataflow, and what autograd saves."""

    def __init__(self) -> None:
        super().__init__()
        self.flow = Dataflow()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kept = ops.kept(func) or ops.reduces(func, args, kwargs, out)
        self.flow.call(func, args, kwargs, out, kept)
        return out


def flow_of(f, *inputs: torch.Tensor) -> list[tuple[str, bool]]:
    """Each call of ``f(*inputs)`` (by operator name) and whether a recomputation needs it."""
    mode = Recorded()

    def pack(t: torch.Tensor) -> torch.Tensor:
        mode.flow.saved(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
        f(*inputs)
    need = mode.flow.needed()
    return [(c.func.overloadpacket.__name__, n) for c, n in zip(mode.flow.calls, need)]


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # Hugging Face's, as written
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + 1e-6)
    return w * h.to(x.dtype)


X = torch.randn(4, 8, 64, dtype=torch.bfloat16, requires_grad=True)
W = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
M = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)


def test_rms_norms_square_is_dead_once_its_mean_is_kept():
    assert flow_of(rms_norm, X, W) == [
        ("_to_copy", True), ("pow", False),  # only the mean reads the square: it is kept
        ("mean", True), ("add", True), ("rsqrt", True), ("mul", True), ("_to_copy", True),
        ("mul", False)]  # what the function returns, nothing saved


def test_a_kept_output_that_only_makes_what_the_block_returns_is_not_needed():
    def layer(x: torch.Tensor) -> torch.Tensor:
        return x + (rms_norm(x, W) @ M)  # the residual sum is returned, the product not saved

    calls = flow_of(layer, X)
    assert calls[-1] == ("add", False)
    assert ("mm", False) in calls  # kept, but nothing saved needs it


def test_in_place_updates_random_draws_and_views_are_followed():
    def f(x: torch.Tensor) -> torch.Tensor:
        h = x * 2  # changed in place below, then read through a view
        h.add_(1)
        unused = torch.nn.functional.dropout(x, 0.5)  # draws: the generator must advance
        del unused
        return h.view(-1).sin()  # sin saves its input: the view of h

    calls = flow_of(f, X)
    assert calls[:2] == [("mul", True), ("add_", True)]  # sin saved a view of their storage
    assert calls[-1] == ("sin", False)  # returned
    drawn = [n for name, n in calls if name in ("native_dropout", "bernoulli_")]
    assert drawn == [True]  # though nothing reads the dropout's output
    assert ("mul", False) in calls[2:]  # the dropout's product: nothing saved reads it


def below(f, region: Region, x: torch.Tensor):
    """``f(x)`` recomputed below the layer through ``region``, as ``recompute.checkpointed``
    runs a block: the first run plainly, the recomputation under the region's mode."""
    runs: list[int] = []

    def body(x: torch.Tensor):
        runs.append(1)
        if len(runs) == 1:
            return f(x)
        with region.recomputing():
            return f(x)

    y = checkpoint(body, x, use_reentrant=False, context_fn=region.contexts)
    region.close(y)
    return y


def llama_layer() -> tuple[torch.nn.Module, torch.Tensor, tuple]:
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=224,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=1, vocab_size=100)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model, cfg


@pytest.mark.parametrize("way", range(len(WEIGHTS)))
def test_the_trace_runs_again_what_the_engine_runs_again(way):
    """The same Llama layer: the kernels the meta-device trace marks as run again by a
    recomputation below the layer (each way) are, operator for operator, those the engine
    runs once the block's choice is made (from its first forward, with the way's weight):
    by the fewest bytes the norms' and the MLP's elementwise work, not the rotary embedding
    (its outputs are kept in place of the query and key projections', ``Dataflow.cut``);
    heavier ways run less of it again, and the gradients are bitwise each way."""
    model, cfg = llama_layer()
    layer = model.model.layers[0]
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    position = model.model.rotary_emb(x, torch.arange(16)[None])
    y = layer(x, position_embeddings=position, attention_mask=None)
    (y[0] if isinstance(y, tuple) else y).float().sum().backward()
    plain, x.grad = x.grad, None
    choice = selective.Choice(WEIGHTS[way])
    y = below(lambda x: layer(x, position_embeddings=position, attention_mask=None),
              Region(None, choice=choice), x)
    (y[0] if isinstance(y, tuple) else y).float().sum().backward()
    assert choice.kept is not None and torch.equal(x.grad, plain)
    x.grad = None
    ran: list[str] = []
    real = selective.Recomputing._run

    def run(self, func, args, kwargs):
        if not func.is_view and func.overloadpacket not in (aten._unsafe_view, aten.detach):
            ran.append(func.overloadpacket.__name__)
        return real(self, func, args, kwargs)

    selective.Recomputing._run = run
    try:
        y = below(lambda x: layer(x, position_embeddings=position, attention_mask=None),
                  Region(None, choice=choice), x)
        y = y[0] if isinstance(y, tuple) else y
        y.float().sum().backward()
    finally:
        selective.Recomputing._run = real
    assert torch.equal(x.grad, plain)
    assert "pow" not in ran and "mm" not in ran
    assert "cat" not in ran and "neg" not in ran and "silu" in ran

    with torch.device("meta"):
        meta = type(model)(cfg).to(torch.bfloat16)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    traced = trace(meta, lambda: meta(input_ids=ids, labels=ids, use_cache=False).loss, [ids])
    again = [k for k in traced.kernels if k.layer == "model.layers.0" and k.again[way:way + 1]
             == (True,)]
    assert len(again) == len(ran) and all(k.kind == "memory" for k in again)
    fewest = [k for k in traced.kernels if k.layer == "model.layers.0" and k.again[:1] == (True,)]
    assert len(again) < len(fewest) if way == len(WEIGHTS) - 1 else len(again) <= len(fewest)


class Flaky(torch.nn.Module):
    """A block whose forward reads a flag the caller flips before backward: its
    recomputation takes another branch, which reads an output found not needed."""

    def __init__(self) -> None:
        super().__init__()
        self.other = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        doubled = x * 2  # needed by nothing saved in the first run
        y = x.sin()
        return (doubled.cos() if self.other else y.cos())


def test_a_recomputation_that_reads_what_its_forward_found_dead_raises():
    block = Flaky()
    y = below(block, Region(None), torch.randn(8, 8, requires_grad=True))
    block.other = True
    with pytest.raises(Exception, match="ran differently than the first time"):
        y.sum().backward()


def test_dead_calls_get_placeholders_and_the_gradients_stay_plain():
    placed: list[str] = []
    real = selective._Dead.placeholder

    def counting(self, tainted):
        out = real(self, tainted)
        placed.append("x")
        return out

    def layer(x: torch.Tensor) -> torch.Tensor:
        return x + (rms_norm(x, W) @ M).relu()

    def grads(region: Region | None) -> list[torch.Tensor]:
        for t in (X, W, M):
            t.grad = None
        y = layer(X) if region is None else below(layer, region, X)
        y.float().square().sum().backward()
        return [t.grad.clone() for t in (X, W, M)]

    plain = grads(None)
    selective._Dead.placeholder = counting
    try:
        got = grads(Region(None))
    finally:
        selective._Dead.placeholder = real
    assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))
    assert placed  # the square, at least, was not run again


def test_a_reduction_is_kept_and_an_empty_output_is_not_one():
    x = torch.randn(4, 256)
    assert ops.reduces(aten.mean.dim, (x, [-1], True), {}, x.mean(-1, keepdim=True))
    assert not ops.reduces(aten.mul.Tensor, (x, x), {}, x * x)
    empty = torch.empty(0)  # batch norm's reserve on the CPU: nothing to keep
    assert not ops.reduces(aten.new_empty.default, (x, [0]), {}, empty)


@pytest.mark.parametrize("func", [torch.ops.aten._scaled_dot_product_efficient_attention.default,
                                  torch.ops.aten._scaled_dot_product_flash_attention.default])
def test_grouped_query_attention_counts_the_work_of_the_querys_heads(func):
    """Llama on CUDA calls attention with 8 key heads for 32 query heads (``enable_gqa``);
    flop_counter's formulas reject that (the GPU check of 2026-11-26 failed there)."""
    def meta(heads):
        return torch.empty(1, heads, 128, 64, device="meta", dtype=torch.bfloat16)

    query = meta(32)
    grouped = ops.flops(func, (query, meta(8), meta(8)), {}, (query,))
    assert grouped == ops.flops(func, (query, meta(32), meta(32)), {}, (query,)) > 0


# the cut: what a recomputation keeps ---------------------------------------------------------
def chain(changed: bool = False, watching: bool = False):
    """mm -> slice copy (a quarter of its bytes) -> times 2 -> saved: the flow and its
    tensors (alive, as in a forward)."""
    flow = Dataflow(watching=watching)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    a = x @ w
    flow.call(aten.mm.default, (x, w), {}, a, kept=True)
    b = a[:, :2].clone()
    flow.call(aten.clone.default, (a[:, :2],), {}, b)
    c = b * 2
    flow.call(aten.mul.Tensor, (b, 2), {}, c)
    if changed:
        c.add_(1)
        flow.call(aten.add_.Tensor, (c, 1), {}, c)
    flow.saved(c)
    return flow, (x, w, a, b, c)


def test_the_cut_keeps_the_fewest_bytes_and_the_latest_of_equally_few():
    flow, _alive = chain()
    assert flow.cut({0}) == {2}  # c: as small as b, and later; nothing runs again
    assert flow.needed(given={2}) == [False, False, True]


def test_the_cut_keeps_nothing_returned_or_changed_in_place_after():
    flow, alive = chain()
    assert flow.cut({0}, returned=[alive[-1]]) == {1}  # c is returned: b kept, c made again
    flow, _alive = chain(changed=True)
    assert flow.cut({0}) == {1}  # c changed in place after it was made


def test_a_blind_flow_keeps_what_it_was_given():
    flow, _alive = chain()
    flow.blind = True
    assert flow.cut({0}) == {0}


@pytest.mark.parametrize("grad", [True, False])
def test_an_activations_cast_is_an_operator_and_a_weights_runs_again_uncounted(grad):
    """A bfloat16 norm's cast of what the block made to float32 may be kept (the cut weighs
    it like any operator); a weight's cast always runs again and is not counted, since
    autocast casts a weight again in a recomputation that found it cached in forward
    (``ops.uncounted``); a view of a weight is cast each time: counted. With or without grad
    mode alike (a first run without autograd is matched against a forward with it)."""
    mode = Recorded()

    def pack(t: torch.Tensor) -> torch.Tensor:
        mode.flow.saved(t)
        return t

    with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode,
          torch.set_grad_enabled(grad)):
        h = (X * 2).to(torch.float32)
        (h * W.to(torch.float32)).exp() @ M.t().to(torch.float32)
    casts = [c for c in mode.flow.calls if c.func is aten._to_copy.default]
    assert [(c.uncounted, c.always) for c in casts] == [(False, False), (True, True),
                                                        (False, False)]
    assert selective._operators(mode.flow).count(aten._to_copy.default) == 2


def test_a_weighted_cut_keeps_more_bytes_where_that_spares_more_work():
    """mm -> times 2 (y) -> exp (z), both saved (exp saves its output, y read by a sin):
    by bytes alone y is kept and exp runs again (its 64 bytes read, 64 written); once a byte
    of that work weighs more than half a byte kept, z is kept beside y and nothing runs."""
    flow = Dataflow()
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    a = x @ w
    flow.call(aten.mm.default, (x, w), {}, a, kept=True)
    y = a * 2
    flow.call(aten.mul.Tensor, (a, 2), {}, y)
    z = y.exp()
    flow.call(aten.exp.default, (y,), {}, z)
    flow.saved(y)
    flow.saved(z)
    assert flow.calls[2].touched == 2 * z.nbytes
    assert flow.cut({0}) == flow.cut({0}, weight=0.4) == {1}
    assert flow.runs({1}) == [False, False, True]
    assert flow.cut({0}, weight=0.6) == {1, 2}
    assert flow.runs({1, 2}) == [False, False, False]


def test_cuts_at_growing_weights_go_on_from_the_last_flow_and_keep_what_fresh_ones_keep():
    """A Llama layer's cuts, made one after another at growing weights (the ways), go on from
    the graph and flow of the one before, and keep what cuts made from nothing keep; a smaller
    weight, other calls given or other tensors returned start afresh."""
    model, _cfg = llama_layer()
    layer = model.model.layers[0]
    x = torch.randn(1, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    emb = model.model.rotary_emb(x, torch.arange(32)[None])
    mode = Recorded()

    def pack(t: torch.Tensor) -> torch.Tensor:
        mode.flow.saved(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
        out = layer(x, position_embeddings=emb)
    out = out[0] if isinstance(out, tuple) else out
    flow = mode.flow
    given = {i for i, c in enumerate(flow.calls) if c.kept}

    def fresh(weight: float, given=given, returned=(out,)) -> set[int]:
        flow._graph = None
        return flow.cut(given, returned, weight)

    expected = [fresh(weight) for weight in (*WEIGHTS, 0.6)]
    assert len({frozenset(c) for c in expected}) > 1  # the weights keep different calls
    flow._graph = None
    warm = [flow.cut(given, [out], WEIGHTS[0])]
    graph = flow._graph
    for weight in (*WEIGHTS[1:], 0.6):
        warm.append(flow.cut(given, [out], weight))
        assert flow._graph is graph  # went on from the last flow
    assert warm == expected
    assert flow.cut(given, [out], 0.0) == expected[0] and flow._graph is not graph
    fewer = set(sorted(given)[1:])
    assert flow.cut(fewer, [out], 0.6) == fresh(0.6, given=fewer)
    assert flow.cut(given, [], 0.6) == fresh(0.6, returned=())


@pytest.mark.parametrize("saved", [False, True])
@pytest.mark.parametrize("leaked", [False, True])
def test_a_product_held_outside_the_block_stays_kept_only_where_autograd_saved_it(leaked, saved):
    """A block whose product its caller can reach afterwards (a leaked list, a cache): where
    autograd saved nothing of it, the caller could change it in place unseen by the version
    the engine checks, or seen where plain PyTorch runs on, so the recomputation makes it
    again; where autograd saved it (``sin``'s input), plain PyTorch's version check sees such
    a change as the engine's does, and it stays kept. Gradients plain either way."""
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    outside: list[torch.Tensor] = []

    def block(x: torch.Tensor) -> torch.Tensor:
        h = torch.mm(x, w)
        if leaked:
            outside.append(h)
        return (h.sin() if saved else torch.cat([h, h], -1).sin()).sum(-1)

    def grads(region: Region | None) -> list[torch.Tensor]:
        x.grad = w.grad = None
        outside.clear()
        y = block(x) if region is None else below(block, region, x)
        y.sum().backward()
        return [x.grad.clone(), w.grad.clone()]

    plain = grads(None)
    region = Region(None)
    got = grads(region)
    assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))
    assert bool(region.made) == (saved or not leaked)


def test_a_watched_flow_holds_the_live_outputs_autograd_saved_nothing_of():
    flow, (_x, _w, a, b, _c) = chain(watching=True)
    assert [id(t) for t in flow.held()] == [id(a), id(b)]  # c was saved
    del a
    assert [id(t) for t in flow.held()] == [id(b)]
    assert not chain()[0].held()  # not watched
