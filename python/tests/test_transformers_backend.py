"""attn_implementation="attnforge" in Hugging Face Transformers: tiny random models built from configs in code (no
downloads) — a GQA Llama, a sliding-window Mistral, Gemma 2 (softcap + sliding window), gpt-oss (sinks + sliding
window) — against "eager" (logits, float32) and "sdpa" (20 greedy tokens; "eager" where the model has no sdpa),
unpadded and left-padded, and a count of the calls attnforge received."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attnforge as af  # noqa: E402
import attnforge.transformers as aft  # noqa: E402

aft.register()

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=97, max_position_embeddings=128, initializer_range=0.2, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)
WINDOW = 6   # shorter than the prompts (and the generated text), so the window changes results

FAMILIES = {   # name: (config class, extra config, features the calls must reach)
    "llama_gqa": ("LlamaConfig", dict(), set()),
    "mistral_sliding": ("MistralConfig", dict(sliding_window=WINDOW), {"window"}),
    "gemma2_softcap": ("Gemma2Config", dict(sliding_window=WINDOW, attn_logit_softcapping=1.5,
                                            final_logit_softcapping=None, query_pre_attn_scalar=16,
                                            tie_word_embeddings=False),   # tied, it repeats the last token
                       {"window", "softcap"}),
    "gpt_oss_sinks": ("GptOssConfig", dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
                      {"window", "sinks"}),
}


def build(family, implementation="eager", **overrides):
    class_name, extra, _ = FAMILIES[family]
    config_class = getattr(transformers, class_name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    torch.manual_seed(0)
    config = config_class(**{**SMALL, **extra, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation)
    return model.eval()


def switch(model, implementation):
    model.set_attn_implementation(implementation)
    return model


class Calls:
    """Counts what reaches attnforge's C entry points, and with which features."""

    def __init__(self, monkeypatch):
        self.sdpa = 0
        self.flash = 0
        self.features = set()
        real_sdpa, real_flash = af._C.sdpa, af._C.flash_attn

        def sdpa(*args, **kwargs):
            self.sdpa += 1
            return real_sdpa(*args, **kwargs)

        def flash(*args, **kwargs):
            self.flash += 1
            if kwargs.get("window") is not None:
                self.features.add("window")
            if kwargs.get("softcap"):
                self.features.add("softcap")
            if kwargs.get("learnable_sink") is not None:
                self.features.add("sinks")
            if kwargs.get("page_table") is not None:
                self.features.add("rows")
            elif kwargs.get("cu_seqlens_q") is not None:
                self.features.add("packed")
            return real_flash(*args, **kwargs)

        monkeypatch.setattr(af._C, "sdpa", sdpa)
        monkeypatch.setattr(af._C, "flash_attn", flash)


def prompt(batch=2, length=14, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, SMALL["vocab_size"], (batch, length), generator=g)


def left_padded(ids, pads):
    """Row b's first pads[b] tokens become padding (attention_mask 0)."""
    ids, mask = ids.clone(), torch.ones_like(ids)
    for b, n in enumerate(pads):
        ids[b, :n] = SMALL["pad_token_id"]
        mask[b, :n] = 0
    return ids, mask


def logits(model, ids, mask=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def assert_logits_close(got, want, mask=None):
    if mask is not None:   # padding rows are not compared: their outputs are undefined in every implementation
        got, want = got[mask.bool()], want[mask.bool()]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_eager(family, monkeypatch):
    model = build(family)
    ids = prompt()
    want = logits(model, ids)
    calls = Calls(monkeypatch)
    got = logits(switch(model, "attnforge"), ids)
    assert_logits_close(got, want)
    assert calls.sdpa + calls.flash == model.config.num_hidden_layers, "every attention call runs on attnforge"
    assert FAMILIES[family][2] <= calls.features, f"the calls must use {FAMILIES[family][2]}"
    assert "rows" not in calls.features, "no mask without padding: the window goes to the kernel"


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_logits_match_eager(family, monkeypatch):
    model = build(family)
    ids, mask = left_padded(prompt(batch=3), [0, 5, 9])
    want = logits(model, ids, mask)
    calls = Calls(monkeypatch)
    got = logits(switch(model, "attnforge"), ids, mask)
    assert_logits_close(got, want, mask)
    assert calls.sdpa + calls.flash == model.config.num_hidden_layers
    if FAMILIES[family][2] & {"softcap", "sinks"}:
        assert "rows" in calls.features, "softcap/sinks under a padding mask: one varlen row per query"


def greedy(model, ids, mask=None, tokens=20):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, pad_token_id=SMALL["pad_token_id"])
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match(family, padded, monkeypatch):
    model = build(family)
    reference = "sdpa" if model._supports_sdpa else "eager"   # Gemma 2 and gpt-oss have no sdpa path
    ids, mask = (left_padded(prompt(), [0, 4]) if padded else (prompt(batch=1), None))
    want = greedy(switch(model, reference), ids, mask)
    calls = Calls(monkeypatch)
    got = greedy(switch(model, "attnforge"), ids, mask)
    assert got.shape == (ids.shape[0], 20)
    assert torch.equal(got, want), f"attnforge {got.tolist()} != {reference} {want.tolist()}"
    assert calls.sdpa + calls.flash >= 20 * model.config.num_hidden_layers, "prefill and every decode step"


def test_registered_names():
    from transformers import AttentionInterface
    assert AttentionInterface._global_mapping[aft.NAME] is aft.attention_forward
    assert AttentionInterface._global_mapping[aft.FLASH_NAME] is aft.attention_forward
    masks = getattr(transformers, "AttentionMaskInterface", None)
    if masks is not None:
        from transformers.masking_utils import flash_attention_mask
        assert masks._global_mapping[aft.NAME] is aft.attention_mask
        assert masks._global_mapping[aft.FLASH_NAME] is flash_attention_mask
    with pytest.raises(ValueError, match="flash"):
        aft.register(flash_name="attnforge_varlen")   # Transformers would not take it for continuous batching


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_flash_name_greedy_tokens_match(family, padded, monkeypatch):
    """attn_implementation="attnforge_flash" outside continuous batching: FlashAttention-style masks (none, or the
    (B, S) padding mask) — the same tokens as the reference."""
    model = build(family)
    reference = "sdpa" if model._supports_sdpa else "eager"
    ids, mask = (left_padded(prompt(), [0, 4]) if padded else (prompt(batch=1), None))
    want = greedy(switch(model, reference), ids, mask, tokens=12)
    calls = Calls(monkeypatch)
    got = greedy(flash_named(model), ids, mask, tokens=12)
    assert torch.equal(got, want), f"attnforge_flash {got.tolist()} != {reference} {want.tolist()}"
    assert calls.sdpa + calls.flash >= 12 * model.config.num_hidden_layers


def flash_named(model):
    """The model under attnforge_flash; a skip where the model class only takes a fixed list of flash kernels (gpt-oss:
    Transformers swaps any other flash name for one of them)."""
    allowed = getattr(type(model), "_compatible_flash_implementations", None)
    if allowed and aft.FLASH_NAME not in allowed:
        pytest.skip(f"{type(model).__name__} only takes the flash implementations {allowed}")
    return switch(model, aft.FLASH_NAME)


CB_PROMPTS = [[1, 5, 7, 9, 11, 13], [1, 20, 21], [1, 30, 31, 32, 33, 34, 35, 36, 37, 38], [1, 40]]


def generate_batch(model, tokens=12):
    """Transformers' continuous batching (paged cache, the batch's sequences packed into one call), small cache."""
    if not hasattr(model, "generate_batch"):
        pytest.skip(f"transformers {transformers.__version__} has no continuous batching")
    config = transformers.GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=-1,
                                           pad_token_id=SMALL["pad_token_id"])
    cb_config = transformers.ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=32)
    with torch.no_grad():
        out = model.generate_batch(inputs=CB_PROMPTS, generation_config=config, continuous_batching_config=cb_config,
                                   progress_bar=False)
    return [out[key].generated_tokens for key in sorted(out, key=lambda k: int(k.split("_")[-1]))]


def greedy_each(model, tokens=12):
    """Each prompt of CB_PROMPTS alone through generate(): the reference for continuous batching."""
    return [greedy(model, torch.tensor([p]), tokens=tokens)[0].tolist() for p in CB_PROMPTS]


@pytest.mark.parametrize("family", FAMILIES)
def test_continuous_batching_matches(family, monkeypatch):
    """generate_batch with attnforge_flash: the packed sequences of each batch (prefill chunks and decode steps mixed)
    run as flash_attn_varlen_func calls and give each prompt's own greedy tokens under "sdpa" (or "eager": both honour
    the softcap, which Transformers' "paged|eager" drops)."""
    model = build(family)
    reference = "sdpa" if model._supports_sdpa else "eager"
    want = greedy_each(switch(model, reference))
    if "softcap" in FAMILIES[family][2]:   # the comparison can see a dropped softcap
        uncapped = greedy_each(build(family, reference, attn_logit_softcapping=None))
        assert uncapped != want, "the config's softcap must change the tokens"
    calls = Calls(monkeypatch)
    got = generate_batch(flash_named(model))
    assert got == want, f"attnforge_flash {got} != {reference} {want}"
    assert len(got) == len(CB_PROMPTS) and all(len(tokens) == 12 for tokens in got)
    assert "packed" in calls.features and calls.sdpa == 0, "every call is one varlen call over the packed batch"
    assert FAMILIES[family][2] <= calls.features, f"the calls must use {FAMILIES[family][2]}"


def test_calls_attnforge_cannot_run_raise():
    model = build("llama_gqa")
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    switch(model, "attnforge").train()
    with torch.no_grad(), pytest.raises(af.UnsupportedError, match="dropout"):
        model(input_ids=prompt())
    q = k = v = torch.randn(1, 2, 3, 8)
    with pytest.raises(af.UnsupportedError, match="indices"):   # a sparse kernel's input: never ignored
        aft.attention_forward(torch.nn.Module(), q, k, v, None, indices=torch.zeros(1, 3, 2, dtype=torch.int32))


def test_packed_sequences_with_gradients():
    """Packed sequences that need gradients run flash_attn_varlen_func with its backward (they raised while
    attnforge had none): dq equals PyTorch's per-sequence causal attention's."""
    q, k, v = (torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    cu_seq_lens = torch.tensor([0, 2, 5], dtype=torch.int32)
    q.requires_grad_()
    out, _ = aft.attention_forward(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=cu_seq_lens,
                                   cu_seq_lens_k=cu_seq_lens)
    (dq,) = torch.autograd.grad(out.sum(), q)
    want = torch.cat([torch.nn.functional.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
                      for a, b in ((0, 2), (2, 5))], dim=2)
    (want_dq,) = torch.autograd.grad(want.sum(), q)
    torch.testing.assert_close(dq, want_dq, atol=1e-5, rtol=1e-5)


AUTOGRAD_WARNING = "run on PyTorch"


def autograd_warnings(caplog):
    return [r for r in caplog.records if r.name == "attnforge" and AUTOGRAD_WARNING in r.getMessage()]


def forward_with_gradients(model, ids, mask=None):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_forward_with_gradients_runs_on_attnforge(monkeypatch, caplog):
    """Autograd on: every attention call runs on attnforge, forward and backward (it went to PyTorch with a warning
    while attnforge had no backward), with "sdpa"'s logits and gradients and no warning; the same calls under
    no_grad and inference_mode."""
    monkeypatch.setattr(aft, "_autograd_warned", False)
    caplog.set_level("WARNING", logger="attnforge")
    model = build("llama_gqa", "sdpa")
    ids, mask = left_padded(prompt(batch=3), [0, 5, 9])
    want = [forward_with_gradients(model, ids), forward_with_gradients(model, ids, mask)]
    calls = Calls(monkeypatch)
    backward_calls = []
    real_backward = af._C.sdpa_backward
    monkeypatch.setattr(af._C, "sdpa_backward", lambda *a, **k: backward_calls.append(1) or real_backward(*a, **k))
    switch(model, "attnforge")
    got = [forward_with_gradients(model, ids), forward_with_gradients(model, ids, mask)]
    layers = model.config.num_hidden_layers
    assert calls.sdpa == 2 * layers and len(backward_calls) == 2 * layers, "forward and backward on attnforge"
    assert not autograd_warnings(caplog)
    for (got_logits, got_grads), (want_logits, want_grads) in zip(got, want):
        torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
        assert got_grads.keys() == want_grads.keys() and got_grads
        for name in want_grads:
            torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    with torch.inference_mode():
        model(input_ids=ids)
    assert calls.sdpa == 4 * layers, "no_grad and inference_mode run on attnforge"


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_with_gradients_match_eager(family, padded, monkeypatch):
    """With gradients every family runs on attnforge (window, softcap, sinks; masked_rows under padding) with
    eager's logits and eager's parameter gradients (of the real tokens' logits: eager's padded rows attend to
    masked keys, attnforge's see none), each within 1e-4 of its largest magnitude (float32; measured <= 5e-6)."""
    model = build(family)
    ids, mask = left_padded(prompt(batch=3), [0, 5, 9]) if padded else (prompt(), None)
    want = logits(model, ids, mask)
    real = mask[..., None].float() if mask is not None else 1.0
    (model(input_ids=ids, attention_mask=mask).logits * real).sum().backward()
    want_grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    calls = Calls(monkeypatch)
    got = switch(model, "attnforge")(input_ids=ids, attention_mask=mask).logits
    assert got.requires_grad and calls.sdpa + calls.flash > 0
    assert_logits_close(got.detach(), want, mask)
    (got * real).sum().backward()
    got_grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert got_grads.keys() == want_grads.keys() and got_grads
    for name, w in want_grads.items():
        assert (got_grads[name] - w).abs().max() <= 1e-4 * w.abs().max(), name


def test_training_with_attention_dropout_runs_on_pytorch(monkeypatch):
    model = build("llama_gqa")
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    switch(model, "attnforge").train()
    calls = Calls(monkeypatch)
    torch.manual_seed(1)
    first = model(input_ids=prompt()).logits
    second = model(input_ids=prompt()).logits
    first.sum().backward()
    assert calls.sdpa + calls.flash == 0
    assert not torch.equal(first, second), "the dropout PyTorch applies"


T5_SMALL = dict(vocab_size=97, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=2, num_heads=4,
                relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=0, eos_token_id=2,
                decoder_start_token_id=0, initializer_factor=1.0)


def build_t5(implementation="eager"):
    torch.manual_seed(0)
    config = transformers.T5Config(**T5_SMALL)
    return transformers.T5ForConditionalGeneration._from_config(config, attn_implementation=implementation).eval()


def test_t5_position_bias_logits_match_eager(monkeypatch):
    """T5's relative position bias folded into the additive mask (as Transformers' sdpa path does): encoder
    self-attention (padding), decoder self-attention (causal) and cross-attention, every call on attnforge."""
    model = build_t5()
    ids, mask = left_padded(prompt(batch=3), [0, 5, 9])
    decoder_ids = prompt(batch=3, length=7, seed=2)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        calls = Calls(monkeypatch)
        got = switch(model, "attnforge")(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert calls.sdpa == T5_SMALL["num_layers"] + 2 * T5_SMALL["num_decoder_layers"] and calls.flash == 0
    trained = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits   # on PyTorch
    torch.testing.assert_close(trained.detach(), want, atol=2e-5, rtol=2e-5)


def test_t5_greedy_tokens_match_sdpa(monkeypatch):
    """Decoding with a cache: one decoder query against its past keys, the bias's last row."""
    model = build_t5("sdpa")
    ids, mask = left_padded(prompt(), [0, 4])
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10,
                              do_sample=False)
        calls = Calls(monkeypatch)
        got = switch(model, "attnforge").generate(input_ids=ids, attention_mask=mask, max_new_tokens=10,
                                                  min_new_tokens=10, do_sample=False)
    assert torch.equal(got, want), f"attnforge {got.tolist()} != sdpa {want.tolist()}"
    assert calls.sdpa >= 10 * 2 * T5_SMALL["num_decoder_layers"]


def test_masks_attnforge_cannot_express_with_softcap_raise():
    q = torch.randn(1, 2, 3, 8)
    k = v = torch.randn(1, 2, 5, 8)
    holes = torch.tensor([[True, False, True, True, True]]).expand(1, 1, 3, 5)   # not one contiguous key range
    module = torch.nn.Module()
    with pytest.raises(af.UnsupportedError, match="contiguous"):
        aft.attention_forward(module, q, k, v, holes, scaling=0.3, softcap=2.0)
    out, weights = aft.attention_forward(module, q, k, v, holes, scaling=0.3)   # no softcap: sdpa takes any mask
    assert out.shape == (1, 3, 2, 8) and weights is None
