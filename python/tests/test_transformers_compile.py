"""attn_implementation="attnforge" under torch.compile(fullgraph=True): a tiny GQA Llama and Gemma 2 (softcap,
sliding window) built from configs in code, forward logits and greedy generate() with a static cache against
"eager", every captured graph without a break and holding attnforge's operators where attention was."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attnforge.transformers as aft  # noqa: E402
from test_transformers_backend import build, prompt  # noqa: E402

aft.register()


class GraphRecorder:
    """A torch.compile backend that keeps each captured graph's attnforge and SDPA call targets."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append([str(n.target) for n in gm.graph.nodes
                            if n.op == "call_function" and ("attnforge" in str(n.target)
                                                            or "scaled_dot_product" in str(n.target))])
        return gm.forward


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family,op", [("llama_gqa", "attnforge.sdpa.default"),
                                       ("gemma2_softcap", "attnforge.flash_attn.default")])
def test_compiled_forward_matches_eager_without_a_break(family, op):
    model = build(family)
    ids = prompt()
    with torch.no_grad():
        want = model(ids).logits
        model.set_attn_implementation("attnforge")
        recorder = GraphRecorder()
        got = torch.compile(model, fullgraph=True, backend=recorder)(ids).logits
        explained = torch._dynamo.explain(model)(ids)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert recorder.graphs == [[op] * model.config.num_hidden_layers]   # every layer's attention, nothing else


@pytest.mark.parametrize("family", ["llama_gqa", "gemma2_softcap"])
def test_compiled_generate_with_a_static_cache_matches_eager(family):
    model = build(family)
    ids = prompt()
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static")
        model.set_attn_implementation("attnforge")
        recorder = GraphRecorder()
        model.forward = torch.compile(model.forward, fullgraph=True, backend=recorder)   # fullgraph: a break raises
        got = model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static")
    assert torch.equal(got, want)
    assert recorder.graphs, "generate() never ran the compiled forward"
    for graph in recorder.graphs:   # prefill and decode graphs: attention on attnforge in every layer
        assert len(graph) == model.config.num_hidden_layers and all(t.startswith("attnforge.") for t in graph), graph
