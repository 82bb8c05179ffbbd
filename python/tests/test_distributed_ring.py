"""attnforge.distributed's ring attention (ring-flash-attn's API) on W = 1..4 gloo ranks of this machine.

Every rank builds the same global inputs from one seed, takes its shard with ring_reference's own layouts, and runs
the ring call forward and backward; its out, lse and dQ/dK/dV (and the sink's gradient) are compared with
(a) attnforge.flash_attn_func / flash_attn_varlen_func on the whole sequence in one process, sharded the same way, and
(b) ring_reference.ring_attention, an independent float64 ring over its own point-to-point exchange,
at PyTorch's context-parallel tolerances (float32: atol 2e-6, rtol 1e-5; bfloat16: atol 8e-3·W, rtol 1e-3·W).

CI has two cores: one process group per world size runs every case of that size (module-scoped cache), shapes are
small (S <= 32·W, D <= 32), and each case reports its failures as strings that the parametrized tests assert on."""
import time
import traceback
import zlib
from typing import NamedTuple, Tuple

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

from dist_harness import run_group  # noqa: E402

F32_TOL = (2e-6, 1e-5)                 # PyTorch CP, efficient attention (float32): atol, rtol


def tolerance(dtype, world):
    """(atol, rtol) of PyTorch's context-parallel tests: float32 fixed, bfloat16 growing with W."""
    return F32_TOL if dtype == torch.float32 else (8e-3 * world, 1e-3 * world)


# ---------------------------------------------------------------- the cases
class Case(NamedTuple):
    """One ring call. local: tokens per rank (batched); docs: varlen, each document's tokens per rank."""
    name: str
    worlds: Tuple[int, ...]
    layout: str = "ring"
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)   # FlashAttention-2's (left, right), -1 unbounded
    softcap: float = 0.0
    sink: bool = False
    heads: Tuple[int, int] = (2, 2)      # (Hq, Hkv)
    dims: Tuple[int, int] = (16, 16)     # (E, Ev)
    dtype: str = "float32"
    batch: int = 1
    local: int = 8
    docs: Tuple[int, ...] = ()
    form: str = ""                       # "", "_kvpacked", "_qkvpacked"
    kind: str = "attention"              # attention, exact, errors, precision


PREFIX = {"ring": "ring_flash_attn", "zigzag": "zigzag_ring_flash_attn", "stripe": "stripe_flash_attn"}

CASES = (
    Case("ring-causal", (1, 2, 3, 4), "ring", causal=True),
    Case("ring-full", (2, 3, 4), "ring", batch=2),
    Case("zigzag-causal", (1, 2, 3, 4), "zigzag", causal=True),
    Case("zigzag-full", (2, 3, 4), "zigzag"),
    Case("stripe-causal", (2, 3, 4), "stripe", causal=True),
    Case("stripe-full", (2, 4), "stripe"),
    Case("zigzag-gqa-ev", (2, 3), "zigzag", causal=True, heads=(4, 2), dims=(16, 8), batch=2),
    Case("ring-window", (2, 3), "ring", window=(5, 3), heads=(4, 1)),
    Case("ring-narrow-window", (4,), "ring", window=(2, 1)),        # most blocks skipped
    Case("zigzag-causal-window", (2, 4), "zigzag", causal=True, window=(6, -1)),
    Case("zigzag-narrow-window", (3,), "zigzag", window=(1, 2)),
    Case("stripe-window", (2, 3), "stripe", window=(4, 2), dims=(16, 24)),
    Case("stripe-causal-window", (3, 4), "stripe", causal=True, window=(5, -1), heads=(4, 2)),
    Case("stripe-causal-softcap", (2, 3), "stripe", causal=True, softcap=2.0),
    Case("zigzag-causal-sink", (1, 2, 3, 4), "zigzag", causal=True, sink=True, heads=(4, 2)),
    Case("stripe-sink", (3,), "stripe", sink=True),
    Case("ring-window-softcap-sink", (2, 4), "ring", window=(3, 5), softcap=1.5, sink=True),
    Case("zigzag-kvpacked-gqa", (2, 3), "zigzag", causal=True, heads=(4, 2), form="_kvpacked"),
    Case("stripe-qkvpacked", (2, 3, 4), "stripe", form="_qkvpacked", heads=(3, 3)),
    Case("varlen-ring-causal", (2, 3, 4), "ring", causal=True, docs=(3, 1, 4), heads=(4, 2)),
    Case("varlen-zigzag-causal", (2, 3, 4), "zigzag", causal=True, docs=(2, 6, 4)),
    Case("varlen-zigzag-window-sink", (2, 3), "zigzag", window=(5, 2), sink=True, docs=(4, 2, 6), dims=(16, 8)),
    Case("varlen-stripe-causal", (2, 4), "stripe", causal=True, docs=(5, 3)),
    Case("varlen-ring-kvpacked", (2,), "ring", docs=(2, 5), form="_kvpacked"),
    Case("varlen-zigzag-qkvpacked", (3,), "zigzag", causal=True, docs=(4, 2), form="_qkvpacked"),
    Case("bf16-zigzag-causal", (2, 3, 4), "zigzag", causal=True, dtype="bfloat16", dims=(32, 32)),
    Case("bf16-ring-gqa", (2, 4), "ring", heads=(4, 2), dtype="bfloat16", batch=2),
    Case("bf16-varlen-zigzag-sink", (2,), "zigzag", causal=True, sink=True, docs=(2, 4), dtype="bfloat16"),
    Case("exact-w1", (1,), kind="exact"),
    Case("errors", (2,), kind="errors"),
    Case("bf16-precision", (4,), "zigzag", causal=True, dtype="bfloat16", dims=(32, 32), local=32,
         kind="precision"),
)


def function_name(case: Case) -> str:
    return PREFIX[case.layout] + ("_varlen" if case.docs else "") + case.form + "_func"


# ---------------------------------------------------------------- inputs and the single-process call
def fa4_window(causal, window):
    """FlashAttention-2's (causal, (left, right), -1 unbounded) as FA4's (causal, (left, right), None unbounded)."""
    left = None if window[0] < 0 else window[0]
    right = None if window[1] < 0 else window[1]
    if causal and left is None:
        return True, (None, None)
    return False, (left, 0 if causal else right)


def make_inputs(case: Case, world: int):
    """The global tensors every rank builds alike (one seed per case): q, k, v, dout, sink, cu_seqlens."""
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    dtype = getattr(torch, case.dtype)
    (hq, hkv), (e, ev) = case.heads, case.dims
    if case.docs:
        lengths = [d * world for d in case.docs]
        lead, cu = (sum(lengths),), torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    else:
        lead, cu = (case.batch, case.local * world), None
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)   # noqa: E731
    sink = torch.randn(hq, generator=g) if case.sink else None
    return {"q": rand(*lead, hq, e), "k": rand(*lead, hkv, e), "v": rand(*lead, hkv, ev),
            "dout": rand(*lead, hq, ev), "sink": sink, "cu": cu}


def single_process(case: Case, x):
    """out, lse, dq, dk, dv, dsink of attnforge's one-process call on the whole sequence."""
    import attnforge
    q, k, v = (x[n].clone().requires_grad_() for n in ("q", "k", "v"))
    sink = x["sink"].clone().requires_grad_() if case.sink else None
    causal, window = fa4_window(case.causal, case.window)
    common = dict(causal=causal, window_size=window, softcap=case.softcap, learnable_sink=sink, return_lse=True)
    if case.docs:
        longest = int((x["cu"][1:] - x["cu"][:-1]).max())
        out, lse = attnforge.flash_attn_varlen_func(q, k, v, cu_seqlens_q=x["cu"], cu_seqlens_k=x["cu"],
                                                    max_seqlen_q=longest, max_seqlen_k=longest, **common)
    else:
        out, lse = attnforge.flash_attn_func(q, k, v, **common)
    out.backward(x["dout"])
    return {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "dsink": sink.grad if case.sink else None}


# ---------------------------------------------------------------- shards (ring_reference's own layouts)
def local_of(case: Case, t, rank, world, lse=False, cu=None):
    """Rank `rank`'s shard of a whole-sequence tensor: tokens along dim 1 (batched), 0 (packed), or lse's last."""
    import ring_reference as ref
    if case.docs:
        return ref.extract_varlen(t, cu.tolist(), case.layout, rank, world, dim=1 if lse else 0)
    return ref.extract(t, case.layout, rank, world, dim=2 if lse else 1)


def ring_call(case: Case, x, rank, world):
    """The public function on this rank's shards, forward and backward: out, lse, dq, dk, dv, dsink (local)."""
    import attnforge.distributed as ad
    fn = getattr(ad, function_name(case))
    q, k, v, dout = (local_of(case, x[n], rank, world, cu=x["cu"]) for n in ("q", "k", "v", "dout"))
    sink = x["sink"].clone().requires_grad_() if case.sink else None
    stack_dim = 1 if case.docs else 2   # packed forms stack K/V (and Q) after the token dims
    if case.form == "_qkvpacked":
        leaves = [torch.stack([q, k, v], dim=stack_dim).requires_grad_()]
    elif case.form == "_kvpacked":
        leaves = [q.requires_grad_(), torch.stack([k, v], dim=stack_dim).requires_grad_()]
    else:
        leaves = [t.requires_grad_() for t in (q, k, v)]
    varlen = ()
    if case.docs:
        cu_local = (x["cu"] // world).to(torch.int32)
        varlen = (cu_local, int((cu_local[1:] - cu_local[:-1]).max()))
    out, lse, probs = fn(*leaves, *varlen, causal=case.causal, window_size=case.window, softcap=case.softcap,
                         learnable_sink=sink, return_attn_probs=True)
    out.backward(dout)
    grads = [t.grad for t in leaves]
    if case.form == "_qkvpacked":
        grads = list(grads[0].unbind(stack_dim))
    elif case.form == "_kvpacked":
        grads = [grads[0], *grads[1].unbind(stack_dim)]
    return {"out": out.detach(), "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2],
            "dsink": sink.grad if case.sink else None, "probs": probs}


def reference_call(case: Case, x, rank, world):
    """ring_reference's float64 ring on this rank's shards."""
    import ring_reference as ref
    q, k, v, dout = (local_of(case, x[n], rank, world, cu=x["cu"]) for n in ("q", "k", "v", "dout"))
    length = None if case.docs else x["q"].shape[1]
    tags = ref.varlen_tags(case.layout, rank, world, x["cu"].tolist()) if case.docs else \
        ref.batched_tags(case.layout, rank, world, length)
    left = None if case.window[0] < 0 else case.window[0]
    right = 0 if case.causal else (None if case.window[1] < 0 else case.window[1])
    return ref.ring_attention(q, k, v, dout, tags, left=left, right=right, softcap=case.softcap, sink=x["sink"])


# ---------------------------------------------------------------- checks
def compare(failures, label, actual, expected, tol):
    """Record assert_close's message under `label` when actual (any float dtype) is off expected."""
    try:
        torch.testing.assert_close(actual.detach().to(torch.float64), expected.detach().to(torch.float64),
                                   atol=tol[0], rtol=tol[1])
    except AssertionError as error:
        failures[label] = str(error)


def check_shards(failures, case: Case, x, rank, world):
    """attnforge.distributed.shard / shard_varlen / unshard(_varlen) against ring_reference's own extraction."""
    import attnforge.distributed as ad
    import ring_reference as ref
    t = x["q"]
    if case.docs:
        cu = x["cu"].tolist()
        mine = ref.extract_varlen(t, cu, case.layout, rank, world)
        theirs = ad.shard_varlen(t, x["cu"], case.layout, rank, world)
        whole = ad.unshard_varlen([ref.extract_varlen(t, cu, case.layout, r, world) for r in range(world)],
                                  x["cu"], case.layout)
    else:
        mine = ref.extract(t, case.layout, rank, world)
        theirs = ad.shard(t, case.layout, rank, world, dim=1)
        whole = ad.unshard([ref.extract(t, case.layout, r, world) for r in range(world)], case.layout, dim=1)
    if not torch.equal(mine, theirs):
        failures["shard"] = f"attnforge.distributed's {case.layout} shard differs from the layout's definition"
    if not torch.equal(whole, t):
        failures["unshard"] = f"unshard of the {case.layout} shards is not the whole sequence"


def attention_case(rank, world, case: Case):
    """Every comparison of one ring call; {label: message} of those that failed."""
    import torch.distributed as dist
    x = make_inputs(case, world)
    tol = tolerance(getattr(torch, case.dtype), world)
    single, mine, ref = single_process(case, x), ring_call(case, x, rank, world), reference_call(case, x, rank, world)
    failures = {}
    check_shards(failures, case, x, rank, world)
    if mine["probs"] is not None:
        failures["return_attn_probs"] = f"the third value is {type(mine['probs']).__name__}, expected None"
    for name in ("out", "lse", "dq", "dk", "dv"):
        compare(failures, f"{name} vs single process", mine[name],
                local_of(case, single[name], rank, world, lse=name == "lse", cu=x["cu"]), tol)
        compare(failures, f"{name} vs reference ring", mine[name], ref[name], tol)
    if case.sink:   # each rank's share, and their sum against the whole
        compare(failures, "dsink share vs reference ring", mine["dsink"], ref["dsink"], tol)
        total = mine["dsink"].clone()
        dist.all_reduce(total)
        compare(failures, "dsink summed over ranks vs single process", total, single["dsink"], tol)
    return failures


# ---------------------------------------------------------------- W = 1, errors, bf16 precision
def exact_case(rank, world, case: Case):
    """At W = 1 every layout's ring function (batched and varlen) equals attnforge.flash_attn_func /
    flash_attn_varlen_func bit for bit: out, lse and every gradient, float32 and bfloat16, with a sink."""
    import attnforge.distributed as ad
    failures = {}
    for layout in ("ring", "zigzag", "stripe"):
        for variant in (Case("w1-f32", (1,), layout, causal=True, window=(5, -1), softcap=1.5, heads=(4, 2),
                             dims=(16, 8), batch=2),
                        Case("w1-f32-odd", (1,), layout, local=7),
                        Case("w1-f32-sink", (1,), layout, sink=True, window=(2, 3)),
                        Case("w1-bf16", (1,), layout, causal=True, heads=(2, 1), dtype="bfloat16"),
                        Case("w1-varlen", (1,), layout, causal=True, sink=True, docs=(3, 6, 1))):
            x = make_inputs(variant, 1)
            single, mine = single_process(variant, x), ring_call(variant, x, 0, 1)
            for name in ("out", "lse", "dq", "dk", "dv", "dsink"):
                if mine[name] is not None and not torch.equal(mine[name], single[name]):
                    diff = (mine[name].double() - single[name].double()).abs().max().item()
                    failures[f"{layout} {variant.name} {name}"] = f"not bit for bit: max |diff| {diff:.3e}"
        odd = torch.arange(7.0).view(1, 7, 1)   # one rank holds the whole sequence in order, whatever its length
        if not torch.equal(ad.shard(odd, layout, 0, 1), odd):
            failures[f"{layout} shard at W = 1"] = f"{ad.shard(odd, layout, 0, 1).flatten().tolist()}"
    probe = make_inputs(Case("w1-probe", (1,)), 1)
    plain = ad.ring_flash_attn_func(probe["q"], probe["k"], probe["v"])
    if not isinstance(plain, torch.Tensor):
        failures["return_attn_probs=False"] = f"returned {type(plain).__name__}, expected the out tensor"
    return failures


def refusal(call):
    """(type name, message) of what call() raised, or None."""
    try:
        call()
    except Exception as error:   # noqa: B902 (the test asserts on the type)
        return type(error).__name__, str(error)
    return None


def errors_case(rank, world, case: Case):
    """Calls that must be refused on every rank before any transfer: {label: (type, message) or None}."""
    import attnforge.distributed as ad
    g = torch.Generator().manual_seed(7)
    odd = [torch.randn(1, 3, 2, 16, generator=g) for _ in range(3)]
    even = [torch.randn(1, 4, 2, 16, generator=g) for _ in range(3)]
    packed = [torch.randn(8, 2, 16, generator=g) for _ in range(3)]
    return {
        "zigzag odd local length": refusal(lambda: ad.zigzag_ring_flash_attn_func(*odd, causal=True)),
        "zigzag varlen odd document": refusal(lambda: ad.zigzag_ring_flash_attn_varlen_func(
            *packed, torch.tensor([0, 3, 8], dtype=torch.int32), 5, causal=True)),
        "dropout_p": refusal(lambda: ad.ring_flash_attn_func(*even, dropout_p=0.1)),
        "alibi_slopes": refusal(lambda: ad.stripe_flash_attn_func(*even, alibi_slopes=torch.ones(2))),
    }


def precision_case(rank, world, case: Case):
    """bf16 at W, two input seeds: per seed and quantity, (the ring's max error, attnforge's one-process bf16 call's
    max error) against the float64 reference ring on the same bf16 inputs, maxima over all ranks."""
    import torch.distributed as dist
    per_seed = []
    for seed in (case, case._replace(name=case.name + "/2")):
        x = make_inputs(seed, world)
        single, mine = single_process(seed, x), ring_call(seed, x, rank, world)
        ref = reference_call(seed, x, rank, world)
        errors = {}
        for name in ("out", "lse", "dq", "dk", "dv"):
            truth = ref[name]
            local_single = local_of(seed, single[name], rank, world, lse=name == "lse", cu=x["cu"])
            pair = torch.stack([(mine[name].double() - truth).abs().max(), (local_single.double() - truth).abs().max()])
            dist.all_reduce(pair, op=dist.ReduceOp.MAX)
            errors[name] = tuple(pair.tolist())
        per_seed.append(errors)
    return per_seed


KINDS = {"attention": attention_case, "exact": exact_case, "errors": errors_case, "precision": precision_case}


def run_cases(rank, world, cases):
    """Every case on this rank, in the same order on every rank: {name: {"result", "seconds"}} (an exception's
    traceback as the result's "exception")."""
    results = {}
    for case in cases:
        start = time.perf_counter()
        try:
            result = KINDS[case.kind](rank, world, case)
        except Exception:   # noqa: B902 (reported per case; the other cases still run)
            result = {"exception": traceback.format_exc()}
        results[case.name] = {"result": result, "seconds": time.perf_counter() - start}
    return results


# ---------------------------------------------------------------- pytest
@pytest.fixture(scope="module")
def group_results():
    """results(world): every rank's run_cases for that world size, one process group per size, run once."""
    cache = {}

    def results(world):
        if world not in cache:
            cases = tuple(c for c in CASES if world in c.worlds)
            try:
                cache[world] = run_group(run_cases, world, cases, timeout=60 + 30 * world, group_timeout=60)
            except AssertionError as error:   # a rank failed or hung: every test of this size reports it
                cache[world] = error
        if isinstance(cache[world], AssertionError):
            raise cache[world]
        return cache[world]

    return results


def results_of(group_results, world, name):
    """Each rank's result of case `name` (a rank's exception fails the test with its traceback)."""
    per_rank = [r[name]["result"] for r in group_results(world)]
    crashed = [f"--- rank {r}:\n{res['exception']}" for r, res in enumerate(per_rank)
               if isinstance(res, dict) and "exception" in res]
    assert not crashed, "\n".join(crashed)
    return per_rank


ATTENTION = [pytest.param(w, c.name, id=f"W{w}-{c.name}") for c in CASES if c.kind == "attention" for w in c.worlds]


@pytest.mark.parametrize("world,name", ATTENTION)
def test_ring_matches_single_process_and_reference(group_results, world, name):
    per_rank = results_of(group_results, world, name)
    assert len(per_rank) == world
    failures = [f"rank {r}: {label}: {message}" for r, res in enumerate(per_rank) for label, message in res.items()]
    assert not failures, "\n".join(failures)


def test_world_of_one_is_flash_attn_func_bit_for_bit(group_results):
    (failures,) = results_of(group_results, 1, "exact-w1")
    assert not failures, "\n".join(f"{label}: {message}" for label, message in failures.items())


@pytest.mark.parametrize("label,words", [("zigzag odd local length", ("odd", "zigzag")),
                                         ("zigzag varlen odd document", ("even", "cu_seqlens")),
                                         ("dropout_p", ("dropout",)), ("alibi_slopes", ("ALiBi",))])
def test_refused_on_every_rank(group_results, label, words):
    for rank, res in enumerate(results_of(group_results, 2, "errors")):
        assert res[label] is not None, f"rank {rank}: {label} was not refused"
        kind, message = res[label]
        assert kind == "InvalidArgumentError", f"rank {rank}: {label} raised {kind}: {message}"
        assert all(w in message for w in words), f"rank {rank}: {label}: {message!r} does not name {words}"


def bf16_ratios(group_results):
    """Per quantity, the largest (ring error / one-process error) over the seeds, and the errors behind it."""
    per_seed = results_of(group_results, 4, "bf16-precision")[0]
    worst = {}
    for errors in per_seed:
        for name, (ring, single) in errors.items():
            ratio = ring / max(single, 1e-12)
            if name not in worst or ratio > worst[name][0]:
                worst[name] = (ratio, ring, single)
    print("\nbf16 W=4, ring error / one-process error (max over seeds):",
          ", ".join(f"{n} {r:.3f} ({a:.2e}/{b:.2e})" for n, (r, a, b) in worst.items()))
    return worst


def test_bf16_error_at_w4_within_1_5x_of_single_process(group_results):
    """The ring's bf16 out, dq, dk and dv are within 1.5x of the one-process bf16 call's max error against float64
    (dK/dV need the blocks' float32 gradients: bf16 block gradients summed over the ring gave 1.6-1.8x)."""
    worst = bf16_ratios(group_results)
    over = {name: worst[name] for name in ("out", "dq", "dk", "dv") if worst[name][0] > 1.5}
    assert not over, f"bf16 ring error above 1.5x the one-process error (ratio, ring, one-process): {over}"
