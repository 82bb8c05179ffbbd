"""attnforge's PyTorch operators (torch.ops.attnforge.*): torch.library.opcheck on each, the Python guard against
the C guard it mirrors, and attention kept inside torch.compile(fullgraph=True) and torch.export graphs: under
attnforge.torch.apply (covered calls → provider_sdpa carrying the plan, uncovered → PyTorch's SDPA), for the
public functions, over changing lengths with dynamic=True, through Inductor, and an exported program saved and
loaded in a new process."""
import random
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attnforge as af  # noqa: E402
import attnforge.torch as aft  # noqa: E402
from attnforge import _ops  # noqa: E402
from gqa_block import Block, randn  # noqa: E402

PYTORCH_SDPA = torch._C._nn.scaled_dot_product_attention


def nhd(b, h, seq, d, dtype=torch.float32, seed=0):
    """An HND view (b, h, seq, d) of NHD-contiguous memory, as a transformer's projections give it."""
    return randn(b, seq, h, d, dtype=dtype, seed=seed).transpose(1, 2)


# ---------------------------------------------------------------- opcheck
def opcheck(op, args):
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("case", ["plain", "bool_mask", "additive_mask", "bottom_right_lse", "gqa_scale"])
def test_opcheck_sdpa(case):
    q, k, v = nhd(2, 4, 5, 8, seed=1), nhd(2, 2, 7, 8, seed=2), nhd(2, 2, 7, 6, seed=3)
    mask, causal, bottom_right, lse, gqa, scale = None, False, False, False, True, None
    if case == "bool_mask":
        mask = randn(5, 7, seed=4) > 0   # (L, S), broadcast over batch and heads
    elif case == "additive_mask":
        mask = randn(2, 1, 5, 7, seed=5)
    elif case == "bottom_right_lse":
        bottom_right, lse = True, True
    elif case == "gqa_scale":
        causal, scale = True, 0.3
    opcheck(torch.ops.attnforge.sdpa.default, (q, k, v, mask, 0.0, causal, scale, gqa, bottom_right, lse))


def test_opcheck_provider_sdpa():
    q = nhd(1, 4, 6, 8)
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare([((q, q, q), {"is_causal": True})])
    view = _ops.plan_view(provider)
    opcheck(torch.ops.attnforge.provider_sdpa.default, (view.json, q, q, q, True, None, False, False))


@pytest.mark.parametrize("case", ["window_softcap_sink", "causal_lse", "varlen_packed", "varlen_paged"])
def test_opcheck_flash_attn(case):
    q, k, v = randn(2, 5, 4, 8, seed=1), randn(2, 9, 2, 8, seed=2), randn(2, 9, 2, 8, seed=3)
    kw = dict(softmax_scale=None, causal=False, windowed=False, window_left=None, window_right=None, softcap=0.0,
              learnable_sink=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
              seqused_k=None, page_table=None, q_descale=None, k_descale=None, v_descale=None, return_lse=False,
              varlen=False)
    if case == "window_softcap_sink":
        kw.update(windowed=True, window_left=3, window_right=None, softcap=2.0, learnable_sink=randn(4, seed=4))
    elif case == "causal_lse":
        kw.update(causal=True, return_lse=True)
    elif case == "varlen_packed":
        q, k, v = randn(7, 4, 8, seed=1), randn(10, 2, 8, seed=2), randn(10, 2, 8, seed=3)
        kw.update(cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32),
                  cu_seqlens_k=torch.tensor([0, 4, 10], dtype=torch.int32), causal=True, return_lse=True, varlen=True)
    elif case == "varlen_paged":
        k, v = randn(6, 4, 2, 8, seed=2), randn(6, 4, 2, 8, seed=3)   # 6 pages of 4 keys
        kw.update(page_table=torch.tensor([[5, 0, 2], [1, 3, 4]], dtype=torch.int32),
                  seqused_k=torch.tensor([9, 12], dtype=torch.int32), causal=True, varlen=True)
    opcheck(torch.ops.attnforge.flash_attn.default, (q, k, v, *kw.values()))


def test_opcheck_masked_rows():
    q, k, v = randn(2, 4, 5, 8, seed=1), randn(2, 2, 7, 8, seed=2), randn(2, 2, 7, 8, seed=3)
    mask = torch.ones(2, 1, 5, 7, dtype=torch.bool).tril(diagonal=2)
    mask[1, :, :, :2] = False   # left padding of the second sequence
    opcheck(torch.ops.attnforge.masked_rows.default, (q, k, v, mask, None, 1.5, randn(4, seed=4)))


def test_backward_through_the_registration():
    """Each operator's Autograd kernel runs a forward that needs a gradient with its backward (this test stood for
    the refusal while attnforge had none): the same outputs as without grad, and PyTorch's gradients eagerly, under
    torch.compile and through the public function. python/tests/test_backward.py checks every operator's."""
    q = randn(1, 2, 4, 8).requires_grad_()
    out, _ = torch.ops.attnforge.sdpa(q, q, q, None, 0.0, False, None, False, False, False)
    with torch.no_grad():
        want, _ = torch.ops.attnforge.sdpa(q, q, q, None, 0.0, False, None, False, False, False)
    assert out.requires_grad and not want.requires_grad and torch.equal(out, want)
    (want_grad,) = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(q, q, q).sum(), q)
    (eager,) = torch.autograd.grad(out.sum(), q)
    compiled = torch.compile(lambda x: torch.ops.attnforge.sdpa(x * 1, x, x, None, 0.0, False, None, False, False,
                                                                False)[0], fullgraph=True)
    (traced,) = torch.autograd.grad(compiled(q).sum(), q)
    (public,) = torch.autograd.grad(af.scaled_dot_product_attention(q, q, q).sum(), q)
    for got in (eager, traced, public):
        torch.testing.assert_close(got, want_grad, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the Python guard mirrors the C guard
def random_call(rng):
    b, hkv, l, s, e = rng.randint(1, 2), rng.choice([1, 2]), rng.randint(1, 6), rng.randint(1, 6), 8
    hq = hkv * rng.choice([1, 2])
    all_nhd = rng.random() < 0.5   # the copy-free layout for all three, half the time

    def tensor(h, seq):
        layout = "nhd" if all_nhd else rng.choice(["nhd", "hnd", "sliced"])
        if layout == "nhd":
            return nhd(b, h, seq, e, seed=rng.randint(0, 99))
        if layout == "hnd":
            return randn(b, h, seq, e, seed=rng.randint(0, 99))
        return randn(b, h, seq, 2 * e, seed=rng.randint(0, 99))[..., :e]

    q, k, v = tensor(hq, l), tensor(hkv, s), tensor(hkv, s)
    kwargs = {}
    if rng.random() < 0.5:
        kwargs["is_causal"] = rng.random() < 0.5
    if rng.random() < 0.4:
        kwargs["scale"] = rng.choice([0.125, 0.3, 1 / e ** 0.5, 0.1])
    if hq != hkv or rng.random() < 0.3:
        kwargs["enable_gqa"] = rng.random() < 0.8
    if rng.random() < 0.15:
        kwargs["attn_mask"] = torch.ones(l, s, dtype=torch.bool)
    if rng.random() < 0.1:
        kwargs["dropout_p"] = 0.5
    if rng.random() < 0.5:
        return (), dict(kwargs, query=q, key=k, value=v)
    return (q, k, v), kwargs


def test_python_guard_agrees_with_the_c_guard():
    rng = random.Random(7)
    providers = []
    for _ in range(12):   # plans from random samples: each form, causality, scale, GQA and layout
        args, kwargs = random_call(rng)
        kwargs = {k: val for k, val in kwargs.items() if k not in ("attn_mask", "dropout_p")}
        provider = af.FlashAttention4KernelProvider(backend="attnforge")
        if provider.prepare([(args, kwargs)]):
            providers.append(provider)
    providers.append(af.FlashAttention4KernelProvider.from_dict(
        {"type": "FlashAttention4KernelProvider", "version": 1, "qkv_source": "positional_qkv",
         "flash_kwargs": {"causal": True}, "copy_free_layout": False, "backend": "cuda"}))
    assert len(providers) >= 8
    covered = mismatched = 0
    for provider in providers:
        view = _ops.plan_view(provider)
        for _ in range(40):
            args, kwargs = random_call(rng)
            mine = view.mismatch(_ops.Call(args, kwargs))
            try:
                provider._c.check_call(args, kwargs)
                theirs = None
            except af.PlanMismatchError as e:
                theirs = str(e)
            want = None if mine is None else f"FlashAttention-4 plan does not match this call ({mine})"
            assert want == theirs, (provider.to_dict(), args, kwargs)
            covered += mine is None
            mismatched += mine is not None
    assert covered >= 10 and mismatched >= 100   # both branches were exercised


def test_refusals_name_the_reason():
    q = randn(1, 2, 4, 8)
    assert _ops.refusal((q, q, q), {}) is None
    assert "float64" in _ops.refusal((q.double(),) * 3, {})
    assert "dropout_p" in _ops.refusal((q, q, q), {"dropout_p": 0.1})
    assert "does not match query's" in _ops.refusal((q, q.half(), q), {})
    assert "neither bool nor" in _ops.refusal((q, q, q), {"attn_mask": torch.zeros(4, 4, dtype=torch.int32)})
    assert _ops.refusal((q[0], q[0], q[0]), {}) is None   # any rank from 2, as PyTorch (the broadcasting rule)
    assert "at least 2 dimensions" in _ops.refusal((q[0, 0, 0], q[0], q[0]), {})
    assert "enable_gqa" in _ops.refusal((q, randn(1, 3, 4, 8), randn(1, 3, 4, 8)), {})
    assert _ops.refusal((q.clone().requires_grad_(), q, q), {}) is None   # attnforge's backward: on the CPU
    assert "attn_mask requires grad" in _ops.refusal((q.clone().requires_grad_(), q, q),
                                                     {"attn_mask": torch.zeros(4, 4, requires_grad=True)})
    with torch.no_grad():
        assert _ops.refusal((q.clone().requires_grad_(), q, q), {}) is None


# ---------------------------------------------------------------- torch.compile and torch.export under apply()
def model_and_plan(blocks=2):
    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(blocks))).eval()
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare(aft.record(model, randn(2, 16, 64)))
    return model, provider


class GraphRecorder:
    """A torch.compile backend that keeps each captured graph's call targets and runs the graph as it is."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    def targets(self, word):
        return [t for g in self.graphs for t in g if word in t]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compile_fullgraph_under_apply_keeps_the_plan_in_the_graph():
    model, provider = model_and_plan()
    x = randn(2, 16, 64, seed=1)
    recorder = GraphRecorder()
    with torch.no_grad(), aft.apply(model, provider):
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True, backend=recorder)(x)
        assert af._C._testing_stats(provider._c)["plan_calls"] == 4   # the caller's own provider ran both
        explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert len(recorder.graphs) == 1
    assert recorder.targets("attnforge") == ["attnforge.provider_sdpa.default"] * 2
    assert not recorder.targets("scaled_dot_product_attention")
    assert torch.equal(compiled, eager)   # the same kernels, the same plan


def test_compile_dynamic_lengths_without_a_recompile_per_length():
    model, provider = model_and_plan()
    recorder = GraphRecorder()
    with torch.no_grad(), aft.apply(model, provider):
        compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=recorder)
        for n in (16, 24, 40, 9, 57):
            x = randn(2, n, 64, seed=n)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-6, rtol=1e-6)
    assert len(recorder.graphs) == 1
    assert len(recorder.targets("attnforge.provider_sdpa")) == 2


def test_compile_sends_uncovered_calls_to_pytorch_and_attnforge_as_asked():
    model, provider = model_and_plan()
    for block in model:
        block.causal = False   # the plan is causal: not covered
    x = randn(2, 16, 64, seed=2)
    for uncovered, want in (("pytorch", "<built-in function scaled_dot_product_attention>"),
                            ("attnforge", "attnforge.sdpa.default")):
        torch._dynamo.reset()
        recorder = GraphRecorder()
        with torch.no_grad(), aft.apply(model, provider, uncovered=uncovered):
            got = torch.compile(model, fullgraph=True, backend=recorder)(x)
            torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-5)
        assert not recorder.targets("provider_sdpa")
        assert recorder.targets("scaled_dot_product_attention") + recorder.targets("attnforge") == [want] * 2


def test_compile_with_inductor():
    model, provider = model_and_plan(blocks=1)
    x = randn(2, 16, 64, seed=3)
    with torch.no_grad(), aft.apply(model, provider):
        eager = model(x)
        got = torch.compile(model, fullgraph=True)(x)
    torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)
    assert af._C._testing_stats(provider._c)["plan_calls"] == 2


def test_export_runs_and_survives_save_and_load_in_a_new_process(tmp_path):
    model, provider = model_and_plan()
    x = randn(2, 16, 64, seed=4)
    with torch.no_grad(), aft.apply(model, provider):
        eager = model(x)
        program = torch.export.export(model, (x,))
    targets = [str(n.target) for n in program.graph.nodes]
    assert targets.count("attnforge.provider_sdpa.default") == 2
    torch.testing.assert_close(program.module()(x), eager, atol=0, rtol=0)   # apply() is no longer needed
    path, x_path, want_path = tmp_path / "model.pt2", tmp_path / "x.pt", tmp_path / "want.pt"
    torch.export.save(program, path)
    torch.save(x, x_path)
    torch.save(eager, want_path)
    script = textwrap.dedent(f"""
        import attnforge, torch   # attnforge first: its operators register when torch arrives
        program = torch.export.load({str(path)!r})
        got = program.module()(torch.load({str(x_path)!r}))
        assert torch.equal(got, torch.load({str(want_path)!r})), "different result after load"
        print("ops", sum(str(n.target).startswith("attnforge.") for n in program.graph.nodes))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ops 2" in done.stdout


# ---------------------------------------------------------------- the public functions in compiled code
def test_public_functions_compile_fullgraph():
    q, k, v = nhd(1, 4, 6, 8, seed=1), nhd(1, 2, 9, 8, seed=2), nhd(1, 2, 9, 8, seed=3)
    mask = randn(6, 9, seed=4) > -0.5

    def attention(q, k, v, mask):
        a = af.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        b, lse = af.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, return_lse=True)
        c, _ = af.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                  window_size=(3, None), softcap=2.0)
        return a, b, lse, c

    recorder = GraphRecorder()
    with torch.no_grad():
        want = attention(q, k, v, mask)
        got = torch.compile(attention, fullgraph=True, backend=recorder)(q, k, v, mask)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert sorted(recorder.targets("attnforge")) == ["attnforge.flash_attn.default"] + ["attnforge.sdpa.default"] * 2


def test_float8_kv_cache_compiles_fullgraph():
    q, k, v = randn(1, 3, 4, 8, seed=1), randn(1, 9, 2, 8, seed=2), randn(1, 9, 2, 8, seed=3)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)

    def decode(q, k8, v8):
        return af.flash_attn_func(q, k8, v8, causal=True, return_lse=True)

    recorder = GraphRecorder()
    want = decode(q, k8, v8)
    got = torch.compile(decode, fullgraph=True, backend=recorder)(q, k8, v8)
    assert got[0].dtype == want[0].dtype == torch.float32 and torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])
    assert recorder.targets("attnforge") == ["attnforge.flash_attn.default"]


def test_varlen_and_paged_compile_fullgraph():
    q, k, v = randn(7, 4, 8, seed=1), randn(6, 4, 2, 8, seed=2), randn(6, 4, 2, 8, seed=3)
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32)
    table = torch.tensor([[5, 0, 2], [1, 3, 4]], dtype=torch.int32)
    used = torch.tensor([9, 12], dtype=torch.int32)

    def paged(q, k, v, cu_q, table, used):
        return af.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, max_seqlen_q=4, page_table=table,
                                         seqused_k=used, causal=True, return_lse=True)

    recorder = GraphRecorder()
    want = paged(q, k, v, cu_q, table, used)
    got = torch.compile(paged, fullgraph=True, backend=recorder)(q, k, v, cu_q, table, used)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert recorder.targets("attnforge") == ["attnforge.flash_attn.default"]
