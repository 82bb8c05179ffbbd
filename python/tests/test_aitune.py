"""attnforge.aitune.AttnforgeKernelProvider against AITune 0.6.0 from PyPI (its own code, imported with
aitune_harness): the provider's lifecycle and plan, what it accepts and refuses, AITune's KernelOptimizer choosing
between it and PyTorch's SDPA on the CPU (with the harness's CPU profiler and timer), the plan's JSON, plan.apply,
torch.compile under AITune's KernelProviderRuntime, and plans shared between AITune's FlashAttention-4 provider and
attnforge's. The GPU side is gpu_aitune_table.py (scripts/gpu-check.sh)."""
import json
import logging
import pathlib
import subprocess
import sys
import textwrap
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("aitune", reason="AITune is not installed (scripts/test-python.sh pins aitune==0.6.0)")

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402

import attnforge as af  # noqa: E402
import aitune_harness as harness  # noqa: E402  (imports AITune's kernel_forge)
from aitune.torch.kernel_forge.kernel_provider import (  # noqa: E402
    FlashAttention4KernelProvider as AITuneFA4,
    KernelProvider,
    KernelProviderState,
    TorchSDPAKernelProvider,
    kernel_provider_from_dict,
)
from attnforge.aitune import AttnforgeKernelProvider  # noqa: E402

KernelOptimizationPlan = harness.KernelOptimizationPlan
KernelProviderRuntime = harness.KernelProviderRuntime
PYTORCH_SDPA = torch._C._nn.scaled_dot_product_attention
HERE = pathlib.Path(__file__).resolve().parent
AITUNE_LOGGER = "attnforge.aitune"


def run_python(code, timeout=120):
    """Run code in a fresh interpreter (this one's), returning its stdout; fails the test on a non-zero exit."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=timeout, cwd=HERE)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
    return result.stdout


def attnforge_ops(fn):
    """(fn's result, {op name: count} of the attnforge:: and aten SDPA operators that ran) under the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn()
    counts = {}
    for event in prof.events():
        if event.name.startswith("attnforge::") or "scaled_dot_product" in event.name:
            counts[event.name] = counts.get(event.name, 0) + 1
    return result, counts


def qkv(b=2, hq=4, hkv=4, l=16, s=16, e=32, ev=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, l, e, generator=g).to(dtype)
    k = torch.randn(b, hkv, s, e, generator=g).to(dtype)
    v = torch.randn(b, hkv, s, ev or e, generator=g).to(dtype)
    return q, k, v


# ---- loading AITune
def test_importing_attnforge_does_not_import_aitune():
    out = run_python("""
        import sys
        import attnforge, attnforge.torch, attnforge.aitune
        print(sorted(m for m in sys.modules if m == "aitune" or m.startswith("aitune.")))
    """)
    assert out.strip() == "[]"


def test_missing_aitune_says_pip_install():
    out = run_python("""
        import sys
        class NotInstalled:   # as if aitune were not installed
            def find_spec(self, name, path=None, target=None):
                if name == "aitune" or name.startswith("aitune."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, NotInstalled())
        import attnforge.aitune
        try:
            attnforge.aitune.AttnforgeKernelProvider
        except ImportError as e:
            print(e)
    """)
    assert "pip install aitune" in out


def test_kernel_forge_only_is_opt_in_and_loads_aitunes_own_files():
    """Where aitune.torch's __init__ cannot import (no TensorRT here), the normal import fails naming the opt-in;
    with it, AITune's real kernel_forge files load and the class works. Where it imports, both ways work."""
    out = run_python("""
        import json, sys
        import attnforge.aitune as a
        report = {}
        try:
            a.load_aitune()
            report["normal"] = "ok"
        except ImportError as e:
            report["normal"] = str(e)
        report["normal_left_no_stub"] = "aitune.torch" not in sys.modules
        module = a.load_aitune(kernel_forge_only=True)
        report["module"] = module.__file__
        report["stub"] = getattr(sys.modules["aitune.torch"], "__attnforge_kernel_forge_only__", False)
        report["path"] = sys.modules["aitune.torch"].__path__[0]
        report["subclass"] = issubclass(a.AttnforgeKernelProvider, module.KernelProvider)
        print(json.dumps(report))
    """)
    report = json.loads(out)
    import aitune
    real = pathlib.Path(aitune.__file__).parent
    assert report["subclass"] is True
    assert pathlib.Path(report["module"]) == real / "torch" / "kernel_forge" / "kernel_provider" / "__init__.py"
    assert pathlib.Path(report["path"]) == real / "torch"
    if report["normal"] == "ok":
        assert report["stub"] is False   # it imported the normal way: nothing is bypassed
    else:
        assert "kernel_forge_only=True" in report["normal"] and "No module named" in report["normal"]
        assert report["normal_left_no_stub"] and report["stub"] is True


def test_class_registered_once_under_its_own_name():
    import attnforge.aitune as a
    assert a.AttnforgeKernelProvider is AttnforgeKernelProvider   # made once per process
    assert issubclass(AttnforgeKernelProvider, KernelProvider)
    assert AttnforgeKernelProvider.__name__ != AITuneFA4.__name__
    with pytest.raises(ValueError, match="already registered: AttnforgeKernelProvider"):
        type("AttnforgeKernelProvider", (KernelProvider,), {})


# ---- lifecycle and plan
def test_lifecycle_init_ready_and_round_trip():
    q, k, v = qkv(hq=4, hkv=2)
    provider = AttnforgeKernelProvider()
    assert provider.state is KernelProviderState.INIT and provider.supported_function == "scaled_dot_product_attention"
    with pytest.raises(RuntimeError, match="must be prepared before inference"):
        provider(q, k, v, enable_gqa=True)
    with pytest.raises(RuntimeError, match="must be prepared before serialization"):
        provider.to_dict()
    assert provider.prepare([((q, k, v), {"is_causal": True, "enable_gqa": True})])
    assert provider.state is KernelProviderState.READY
    assert provider.attnforge_provider.plan_backend == "cpu"
    assert provider.name == f"attnforge {af.__version__} (cpu plan, {af.get_isa()})"
    state = provider.to_dict()
    assert state["type"] == "AttnforgeKernelProvider" and state["version"] == 1
    assert state["attnforge_version"] == af.__version__ and state["backends"] == ["cpu"]
    assert state["plan"]["flash_kwargs"] == {"causal": True, "pack_gqa": False}
    restored = kernel_provider_from_dict(json.loads(json.dumps(state)))
    assert type(restored) is AttnforgeKernelProvider and restored.state is KernelProviderState.READY
    assert restored.to_dict() == state and restored.name == provider.name
    want = PYTORCH_SDPA(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(restored(q, k, v, is_causal=True, enable_gqa=True), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["dropout", "float64", "mask_requires_grad", "meta", "empty"])
def test_refuses_what_attnforge_does_not_compute(case, caplog):
    caplog.set_level(logging.DEBUG, logger=AITUNE_LOGGER)
    q, k, v = qkv()
    samples = {
        "dropout": [((q, k, v), {"dropout_p": 0.1})],
        "float64": [((q.double(), k.double(), v.double()), {})],
        "mask_requires_grad": [((q, k, v), {"attn_mask": torch.zeros(16, 16, requires_grad=True)})],
        "meta": [((q.to("meta"), k.to("meta"), v.to("meta")), {})],
        "empty": [],
    }[case]
    provider = AttnforgeKernelProvider()
    assert provider.prepare(samples) is False
    assert provider.state is KernelProviderState.INIT
    lines = [r.getMessage() for r in caplog.records if r.name == AITUNE_LOGGER and r.levelno == logging.DEBUG]
    assert lines and lines[-1].startswith("attnforge not supported due to: ")
    word = {"dropout": "dropout", "float64": "float64", "mask_requires_grad": "attn_mask requires grad", "meta": "meta",
            "empty": "no representative samples"}[case]
    assert word in lines[-1]


def test_accepts_calls_that_need_gradients():
    """A CPU call that needs gradients is prepared and run on attnforge, forward and backward (it was refused while
    attnforge had no backward), with PyTorch's gradients; the mask's gradient alone is refused (above)."""
    q, k, v = (t.requires_grad_() for t in qkv(hkv=2))
    provider = AttnforgeKernelProvider()
    assert provider.prepare([((q, k, v), {"is_causal": True, "enable_gqa": True})])
    got, ops = attnforge_ops(lambda: provider(q, k, v, is_causal=True, enable_gqa=True))
    assert ops == {"attnforge::provider_sdpa": 1}
    grads = torch.autograd.grad(got.sum(), (q, k, v))
    want = torch.autograd.grad(PYTORCH_SDPA(q, k, v, is_causal=True, enable_gqa=True).sum(), (q, k, v))
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def _accepted_cases():
    q, k, v = qkv(l=16, s=24)
    g = torch.Generator().manual_seed(1)
    bool_mask = torch.rand(1, 1, 16, 24, generator=g) > 0.3
    bool_mask[..., 0] = True   # every row sees a key
    additive = torch.randn(2, 1, 16, 24, generator=g)
    x_nhd = torch.randn(2, 16, 4, 32)
    qm, km, vm = qkv(hq=8, hkv=1)
    q16, k16, v16 = qkv(dtype=torch.float16)
    qb, kb, vb = qkv(dtype=torch.bfloat16, e=64, ev=48)
    return {   # name: (samples, whether the C plan serves them, tolerance)
        "bool mask broadcast": ([((q, k, v), {"attn_mask": bool_mask})], False, 1e-5),
        "additive mask": ([((q, k, v, additive), {})], False, 1e-5),
        "causal L<S top-left": ([((q, k, v), {"is_causal": True})], True, 1e-5),
        "causal L>S top-left": ([((k, q, q), {"is_causal": True})], True, 1e-5),
        "MQA with scale": ([((qm, km, vm), {"enable_gqa": True, "scale": 0.3})], True, 1e-5),
        "NHD views (copy-free)": ([((x_nhd.transpose(1, 2),) * 3, {})], True, 1e-5),
        "keyword qkv": ([((), {"query": q, "key": k, "value": v})], True, 1e-5),
        "float16": ([((q16, k16, v16), {"is_causal": True})], True, 2e-3),
        "bfloat16, Ev != E": ([((qb, kb, vb), {})], True, 2e-2),
        "samples that differ": ([((q, k, v), {}), ((q, k, v), {"is_causal": True})], False, 1e-5),
    }


@pytest.mark.parametrize("name", list(_accepted_cases()))
def test_accepts_every_call_attnforge_computes(name):
    samples, planned, tolerance = _accepted_cases()[name]
    provider = AttnforgeKernelProvider()
    assert provider.prepare(samples)
    assert (provider.attnforge_provider is not None) is planned
    for args, kwargs in samples:
        got, ops = attnforge_ops(lambda: provider(*args, **kwargs))
        torch.testing.assert_close(got, PYTORCH_SDPA(*args, **kwargs), atol=tolerance, rtol=tolerance)
        assert ops == {"attnforge::provider_sdpa" if planned else "attnforge::sdpa": 1}


def test_a_call_it_cannot_compute_goes_to_pytorch():
    q, k, v = qkv()
    provider = AttnforgeKernelProvider()
    assert provider.prepare([((q, k, v), {})])
    got, ops = attnforge_ops(lambda: provider(q.double(), k.double(), v.double()))
    assert got.dtype == torch.float64 and not any(name.startswith("attnforge::") for name in ops)
    torch.testing.assert_close(got, PYTORCH_SDPA(q.double(), k.double(), v.double()))


def _state():
    q, k, v = qkv()
    provider = AttnforgeKernelProvider()
    assert provider.prepare([((q, k, v), {})])
    return provider.to_dict()


@pytest.mark.parametrize("change, error", [
    (lambda s: s.update(version=2), "version 2 is newer"),
    (lambda s: s.update(version="1"), "version must be a positive integer"),
    (lambda s: s.update(extra=1), r"unknown fields \['extra'\]"),
    (lambda s: s.pop("plan"), r"missing fields \['plan'\]"),
    (lambda s: s.update(backends=["tpu"]), "backends must be a non-empty list"),
    (lambda s: s.update(backends=["cuda"]), "plan.backend 'cpu' is not one of backends"),
    (lambda s: s.update(plan=[]), "plan must be attnforge's plan"),
])
def test_from_dict_names_what_is_wrong(change, error):
    state = _state()
    change(state)
    with pytest.raises(ValueError, match=error):
        AttnforgeKernelProvider.from_dict(state)


def test_from_dict_checks_the_c_plan_and_the_type():
    state = _state()
    state["plan"]["flash_kwargs"]["causal"] = "yes"
    with pytest.raises(af.ParseError, match="causal"):
        AttnforgeKernelProvider.from_dict(state)
    with pytest.raises(ValueError, match="Invalid kernel provider type"):
        AttnforgeKernelProvider.from_dict(dict(_state(), type="FlashAttention4KernelProvider"))


def test_general_path_plan_loads_its_backend_when_applied():
    provider = AttnforgeKernelProvider.from_dict({"type": "AttnforgeKernelProvider", "version": 1,
                                                  "attnforge_version": af.__version__, "backends": ["cpu"],
                                                  "plan": None})
    assert provider.name == f"attnforge {af.__version__} (general path on cpu, {af.get_isa()})"
    KernelProviderRuntime(torch.nn.Identity(), KernelOptimizationPlan((provider,)))   # loads the CPU backend
    if torch.cuda.is_available():
        pytest.skip("the CUDA case below is for machines without a GPU")
    cuda = AttnforgeKernelProvider.from_dict({"type": "AttnforgeKernelProvider", "version": 1,
                                              "attnforge_version": af.__version__, "backends": ["cuda"],
                                              "plan": None})
    with pytest.raises(af.RuntimeUnavailableError):   # AITune applies a plan: the error comes then, not mid-forward
        KernelProviderRuntime(torch.nn.Identity(), KernelOptimizationPlan((cuda,)))


# ---- AITune's KernelOptimizer on the CPU
@pytest.fixture(scope="module")
def selection():
    """AITune's KernelOptimizer over attnforge's provider and PyTorch's SDPA providers, on the tiny GQA model
    (512 tokens: around where attnforge's CPU kernel overtakes PyTorch's on a 2-core machine, docs/AITUNE.md)."""
    model, x = harness.tiny_model(tokens=512)
    provider = AttnforgeKernelProvider()
    providers = [provider, TorchSDPAKernelProvider(SDPBackend.FLASH_ATTENTION),
                 TorchSDPAKernelProvider(SDPBackend.MATH)]
    optimizer, utils = harness.cpu_optimizer(providers)
    plan = optimizer.make_plan(model, [((x,), {})])
    return types.SimpleNamespace(model=model, x=x, provider=provider, plan=plan, measurements=utils.measurements)


def test_optimizer_selection_agrees_with_its_measurements(selection, capsys):
    rows = harness.selection_rows(selection.measurements, selection.plan)
    with capsys.disabled():
        print("\n" + harness.format_table(rows, "AITune KernelOptimizer on this CPU (tiny GQA model, float32, "
                                                "1 x 512 tokens, 8/2 heads of 32):"))
    candidates = {label: ms for label, ms in selection.measurements if label != harness.BASELINE}
    baseline = [ms for label, ms in selection.measurements if label == harness.BASELINE][-1]
    assert str(selection.provider) in candidates   # it passed AITune's validation and was timed
    # the samples AITune's profiler recorded (2 layers, one distinct call) gave attnforge's C plan
    assert selection.provider.attnforge_provider.to_dict()["flash_kwargs"] == {"causal": True, "pack_gqa": False}
    fastest = min(candidates, key=candidates.get)
    picked = [str(p) for p in selection.plan.providers]
    assert picked == ([fastest] if candidates[fastest] < baseline else [])


def test_optimization_plan_survives_json(selection):
    for plan in (selection.plan, KernelOptimizationPlan((selection.provider,))):
        state = plan.to_dict()
        restored = KernelOptimizationPlan.from_dict(json.loads(json.dumps(state)))
        assert restored.to_dict() == state
        assert [type(p).__name__ for p in restored.providers] == [type(p).__name__ for p in plan.providers]


def _json_plan(provider):
    return KernelOptimizationPlan.from_dict(json.loads(json.dumps(KernelOptimizationPlan((provider,)).to_dict())))


def test_plan_apply_runs_the_model_on_attnforge(selection):
    model, x = selection.model, selection.x
    with torch.no_grad():
        want = model(x)
    with _json_plan(selection.provider).apply(model):
        got, ops = attnforge_ops(lambda: model(x))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert ops == {"attnforge::provider_sdpa": 2}   # both layers, none on PyTorch's SDPA
    assert F.scaled_dot_product_attention is PYTORCH_SDPA   # AITune's runtime put PyTorch's function back


def test_masked_model_runs_on_the_general_path():
    model, x = harness.tiny_model(mask=True)
    provider = AttnforgeKernelProvider()
    assert provider.prepare(attnforge_samples(model, x)) and provider.attnforge_provider is None
    with torch.no_grad():
        want = model(x)
    with _json_plan(provider).apply(model):
        got, ops = attnforge_ops(lambda: model(x))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert ops == {"attnforge::sdpa": 2}


@pytest.mark.parametrize("mask", [False, True], ids=["C plan", "general path"])
def test_compile_under_the_runtime_keeps_attnforge_ops_in_one_graph(mask):
    model, x = harness.tiny_model(mask=mask)
    samples = attnforge_samples(model, x)
    provider = AttnforgeKernelProvider()
    assert provider.prepare(samples)
    runtime = KernelProviderRuntime(model, KernelOptimizationPlan((provider,)))
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with runtime.applied():
        want = model(x)
        got = torch.compile(model, backend=recording_backend, fullgraph=True)(x)
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    op = "attnforge.sdpa.default" if mask else "attnforge.provider_sdpa.default"
    assert len(graphs) == 1 and targets.count(op) == 2   # one graph: no break at either layer
    assert not any("scaled_dot_product_attention" in t for t in targets)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def attnforge_samples(model, x):
    """The model's SDPA calls, as AITune's profiler records them."""
    profiler = harness.CpuModuleFunctionKernelProfiler(function_names={"scaled_dot_product_attention"})
    _, function_data = profiler.profile(model, [((x,), {})], module=model)
    return [sample for _, sample in function_data["scaled_dot_product_attention"]]


# ---- plans shared with AITune's FlashAttention-4 provider
def _fa4_cases():
    q, k, v = qkv(b=2, hq=4, hkv=4, l=17, s=19, e=8)   # the seed's test vector
    qg, kg, vg = qkv(hq=4, hkv=2)
    x_nhd = torch.randn(2, 16, 4, 32)
    return {
        "positional causal scale": [((q, k, v), {"is_causal": True, "scale": 0.125})],
        "keyword causal scale": [((), {"query": q, "key": k, "value": v, "is_causal": True, "scale": 0.125})],
        "GQA": [((qg, kg, vg), {"enable_gqa": True})],
        "copy-free NHD views": [((x_nhd.transpose(1, 2),) * 3, {"is_causal": True})],
    }


SEED_FIELDS = ("type", "qkv_source", "flash_kwargs", "copy_free_layout")


def _seed_fields(state):
    return {key: state[key] for key in SEED_FIELDS}


@pytest.mark.parametrize("name", list(_fa4_cases()))
def test_fa4_plans_are_read_both_ways_and_agree(name):
    samples = _fa4_cases()[name]
    ours = af.FlashAttention4KernelProvider(backend="attnforge")
    theirs = AITuneFA4()   # its prepare needs no flash_attn: it derives the plan from the samples alone
    assert ours.prepare(samples) and theirs.prepare(samples)
    assert _seed_fields(ours.to_dict()) == _seed_fields(theirs.to_dict())
    from_ours = kernel_provider_from_dict(json.loads(json.dumps(ours.to_dict())))   # AITune's registry
    assert type(from_ours) is AITuneFA4 and from_ours.state is KernelProviderState.READY
    assert _seed_fields(from_ours.to_dict()) == _seed_fields(theirs.to_dict())
    from_theirs = af.FlashAttention4KernelProvider.from_dict(json.loads(json.dumps(theirs.to_dict())))
    assert from_theirs.to_dict() == ours.to_dict()


@pytest.mark.parametrize("kwargs", [{"attn_mask": torch.ones(16, 16, dtype=torch.bool)}, {"dropout_p": 0.1}],
                         ids=["mask", "dropout"])
def test_fa4_providers_refuse_alike(kwargs):
    q, k, v = qkv()
    assert af.FlashAttention4KernelProvider(backend="attnforge").prepare([((q, k, v), kwargs)]) is False
    assert AITuneFA4().prepare([((q, k, v), kwargs)]) is False


# ---- the GPU script's plumbing, on the CPU
def test_gpu_table_script_runs_on_the_cpu():
    result = subprocess.run([sys.executable, str(HERE / "gpu_aitune_table.py"), "--cpu-smoke", "--dtype", "float32",
                             "--tokens", "64"], capture_output=True, text=True, timeout=180, cwd=HERE)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert "AITune KernelSelectorBackend on cpu" in result.stdout and "output matches eager PyTorch" in result.stdout
    assert "attnforge " in result.stdout and "plan: {\"providers\": [" in result.stdout
