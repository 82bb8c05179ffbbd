"""attn_implementation="attnforge_flex" in Hugging Face Transformers: tiny random models built from configs in code —
a GQA Llama, a sliding-window Mistral, Gemma 2 (softcap + sliding window) — on packed documents (position_ids that
restart) and left-padded batches, against "eager": logits, and the gradients of a training step. Every attention call
runs attnforge.flex_attention with a block mask built by attnforge.create_block_mask (counted), so packed documents
and windows run block-sparse instead of through a dense mask."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attnforge as af  # noqa: E402
import attnforge.transformers as aft  # noqa: E402
from test_transformers_backend import SMALL, build  # noqa: E402

aft.register()

FAMILIES = ["llama_gqa", "mistral_sliding", "gemma2_softcap"]   # test_transformers_backend's configs


def inputs(padded):
    ids = torch.randint(3, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    if padded:   # left padding: row 1's first 5 tokens
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        ids[1, :5] = SMALL["pad_token_id"]
        return dict(input_ids=ids, attention_mask=mask), mask.bool()
    positions = torch.cat([torch.arange(9), torch.arange(4), torch.arange(11)]).expand(2, 24)   # three documents
    return dict(input_ids=ids, position_ids=positions), None


class FlexCalls:
    def __init__(self, monkeypatch):
        self.calls, self.with_blocks = 0, 0
        real = af._C.flex_attn

        def counted(*args, **kwargs):
            self.calls += 1
            self.with_blocks += kwargs.get("block_mask") is not None
            return real(*args, **kwargs)

        monkeypatch.setattr(af._C, "flex_attn", counted)


@pytest.mark.parametrize("padded", [False, True], ids=["packed documents", "left-padded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_eager(family, padded, monkeypatch):
    model = build(family)
    kwargs, keep = inputs(padded)
    with torch.no_grad():
        want = model(**kwargs).logits
        model.set_attn_implementation(aft.FLEX_NAME)
        calls = FlexCalls(monkeypatch)
        got = model(**kwargs).logits
    assert calls.calls == SMALL["num_hidden_layers"] and calls.with_blocks == calls.calls
    if keep is not None:
        got, want = got[keep], want[keep]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("family", ["llama_gqa", "gemma2_softcap"])
def test_training_step_gradients_match_eager(family):
    grads = []
    for implementation in ("eager", aft.FLEX_NAME):
        model = build(family).train()
        model.set_attn_implementation(implementation)
        kwargs, _ = inputs(padded=False)
        model(**kwargs, labels=kwargs["input_ids"]).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if "q_proj" in n or "k_proj" in n})
    for name, want in grads[0].items():
        torch.testing.assert_close(grads[1][name], want, atol=1e-4, rtol=1e-3, msg=lambda m: f"{name}: {m}")


def test_what_flex_cannot_run_raises():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(af.UnsupportedError, match="sinks"):
        aft.flex_attention_forward(torch.nn.Module(), q, q, q, None, s_aux=torch.zeros(2))
    with pytest.raises(af.UnsupportedError, match="dense mask"):
        aft.flex_attention_forward(torch.nn.Module(), q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))
