"""Context parallelism inside Transformers models (attnforge.distributed.transformers): shard_batch's pieces put back
together are the whole batch's, the loss helpers equal Transformers' own loss, and over 2 gloo ranks the example's 20
training steps give the single-process losses, tiny GQA / sliding-window / softcap / sink models give the whole
sequence's logits and gradients, and a mask is refused on every rank (no hang)."""
import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="attnforge.distributed.transformers needs transformers")

import attnforge.distributed.transformers as cpt  # noqa: E402
from attnforge import _C  # noqa: E402
from attnforge.distributed import positions, shard, unshard  # noqa: E402

import dist_harness  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples",
                       "train_context_parallel.py")
TOLERANCE = 1e-4
LENGTH, WINDOW = 64, 20   # WINDOW crosses the zigzag chunks of 16 tokens (W = 2)
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=97, max_position_embeddings=LENGTH, initializer_range=0.2, use_cache=False)
FAMILIES = {   # name: (config class, extra config): GQA, a causal window, softcap + window, sinks + window
    "llama_gqa": ("LlamaConfig", dict()),
    "mistral_sliding": ("MistralConfig", dict(sliding_window=WINDOW)),
    "gemma2_softcap": ("Gemma2Config", dict(sliding_window=WINDOW, attn_logit_softcapping=1.5,
                                            final_logit_softcapping=None, query_pre_attn_scalar=16,
                                            tie_word_embeddings=False)),
    "gpt_oss_sinks": ("GptOssConfig", dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2)),
}


def _example():
    """examples/train_context_parallel.py as a module."""
    spec = importlib.util.spec_from_file_location("train_context_parallel", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- one process
@pytest.mark.parametrize("layout", ["zigzag", "ring", "stripe"])
@pytest.mark.parametrize("world", [2, 4])
def test_shard_batch_unshards_to_the_whole_batch(monkeypatch, layout, world):
    """Every rank's input_ids, position_ids and labels, put back together, are the whole batch's tokens, positions
    0..S-1 and labels shifted over the whole sequence; num_items counts the whole batch's labels."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (2, 32), generator=generator)
    labels = ids.clone()
    labels[0, 5] = cpt.IGNORE_INDEX
    pieces = []
    for rank in range(world):
        monkeypatch.setattr(cpt, "rank_and_world", lambda group=None, rank=rank: (rank, world))
        pieces.append(cpt.shard_batch(ids, labels, layout=layout))
        assert torch.equal(pieces[-1].position_ids[0], positions(layout, rank, world, 32))
    whole = [unshard([getattr(p, field) for p in pieces], layout, dim=1)
             for field in ("input_ids", "position_ids", "labels")]
    expected_labels = torch.cat([labels[:, 1:], torch.full((2, 1), cpt.IGNORE_INDEX)], dim=1)
    assert torch.equal(whole[0], ids)
    assert torch.equal(whole[1], torch.arange(32).expand(2, 32))
    assert torch.equal(whole[2], expected_labels)
    assert all(p.num_items == 2 * 31 - 1 for p in pieces)


def test_shard_batch_positions_and_refusals(monkeypatch):
    """Given positions are kept (global, an offset start allowed); positions that restart (packed documents) and
    an odd zigzag length are refused."""
    ids = torch.arange(16).reshape(1, 16)
    monkeypatch.setattr(cpt, "rank_and_world", lambda group=None: (1, 2))
    batch = cpt.shard_batch(ids, position_ids=torch.arange(5, 21).reshape(1, 16))
    assert torch.equal(batch.position_ids[0], 5 + positions("zigzag", 1, 2, 16))
    with pytest.raises(_C.UnsupportedError, match="packed documents"):
        cpt.shard_batch(ids, position_ids=torch.cat([torch.arange(8), torch.arange(8)]).reshape(1, 16))
    with pytest.raises(_C.InvalidArgumentError):
        cpt.shard_batch(torch.arange(18).reshape(1, 18))


def test_loss_helpers_equal_transformers_loss():
    """One process: loss_sum / loss_across_ranks on shard_batch's shifted labels, and Transformers' loss given them
    as shift_labels with num_items_in_batch, both equal model(labels=ids).loss."""
    model = _build("llama_gqa", "eager")
    ids = torch.randint(0, 97, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    reference = model(input_ids=ids, labels=ids).loss
    batch = cpt.shard_batch(ids)
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
    ours = cpt.loss_across_ranks(*cpt.loss_sum(logits, batch.labels))
    theirs = model(input_ids=batch.input_ids, labels=batch.labels, shift_labels=batch.labels,
                   num_items_in_batch=batch.num_items).loss
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=0)
    torch.testing.assert_close(theirs, reference, rtol=1e-6, atol=0)


def test_outside_context_parallel_it_is_attnforge_with_padding():
    """Outside context_parallel() "attnforge_cp" is single-process attnforge, padding masks included (its mask
    function is attnforge's: Transformers would drop the mask of an implementation without one)."""
    import attnforge.transformers as aft
    aft.register()
    cpt.register()
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0   # left padding
    outputs = []
    for implementation in ("attnforge", cpt.NAME):
        model = _build("mistral_sliding", implementation)
        with torch.no_grad():
            outputs.append(model(input_ids=ids, attention_mask=mask).logits)
    assert cpt.active() is None
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)


# ---------------------------------------------------------------- two ranks
def _build(family, implementation):
    class_name, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, class_name)(**{**SMALL, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation)
    return model.eval().to(torch.float32)


def _compare_family(family, checkpointing=False):
    """(max |logits - whole|, max over parameters of max |grad - whole| / max |whole grad|) of one CP forward and
    backward against the whole sequence on eager attention in this process."""
    model = _build(family, "eager")
    if checkpointing:   # the backward runs each layer's forward, the ring included, again
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        model.train()
    ids = torch.randint(0, 97, (2, LENGTH), generator=torch.Generator().manual_seed(2))
    whole_logits = model(input_ids=ids).logits
    shifted = cpt.shift_labels(ids)
    total, count = cpt.loss_sum(whole_logits, shifted)
    (total / count).backward()
    whole_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with cpt.context_parallel(model=model):
        batch = cpt.shard_batch(ids)
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
        cpt.loss_across_ranks(*cpt.loss_sum(logits, batch.labels)).backward()
    cpt.sum_gradients(model)
    rank, world = cpt.rank_and_world()
    logits_error = (logits - shard(whole_logits.detach(), "zigzag", rank, world)).abs().max().item()
    grad_error = max(((p.grad - whole_grads[n]).abs().max() / whole_grads[n].abs().max().clamp(min=1e-30)).item()
                     for n, p in model.named_parameters() if n in whole_grads)
    return logits_error, grad_error


def _refusal():
    """The message every rank raises for a model call with an attention mask under context parallelism."""
    model = _build("llama_gqa", "eager")
    with cpt.context_parallel(model=model):
        batch = cpt.shard_batch(torch.zeros(1, LENGTH, dtype=torch.int64))
        try:
            model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                  attention_mask=torch.ones_like(batch.input_ids))
        except _C.UnsupportedError as error:
            return str(error)
    return None


def _gradient_presence(rank):
    """sum_gradients over parameters with a gradient on both ranks, on rank 1 only, on none: (sum, sum, None)."""
    both, one, none = (torch.nn.Parameter(torch.zeros(3)) for _ in range(3))
    both.grad = torch.full((3,), 1.0 + rank)
    if rank == 1:
        one.grad = torch.full((3,), 5.0)
    cpt.sum_gradients([both, one, none])
    return both.grad.tolist(), one.grad.tolist(), none.grad


def _rank_main(rank, world, steps):
    example = _example()
    single, parallel, worst = example.check(steps, None, "zigzag", log=lambda *args, **kwargs: None)
    families = {name: _compare_family(name) for name in FAMILIES}
    families["llama_gqa_checkpointed"] = _compare_family("llama_gqa", checkpointing=True)
    return dict(single=single, parallel=parallel, worst=worst, families=families, refusal=_refusal(),
                after=cpt.active(), gradients=_gradient_presence(rank))


@pytest.fixture(scope="module")
def two_ranks():
    return dist_harness.run_group(_rank_main, 2, 20, timeout=150)


def test_example_cp_losses_equal_single_process(two_ranks):
    """torchrun's --check path over 2 ranks: 20 AdamW steps of the tiny Llama with zigzag context parallelism give
    the single-process losses to 1e-4 relative, the same on both ranks."""
    for result in two_ranks:
        assert len(result["parallel"]) == len(result["single"]) == 20
        worst = max(abs(c - s) / abs(s) for c, s in zip(result["parallel"], result["single"]))
        assert worst <= TOLERANCE, (worst, result["parallel"], result["single"])
    assert two_ranks[0]["parallel"] == two_ranks[1]["parallel"]
    assert two_ranks[0]["single"][-1] < 0.75 * two_ranks[0]["single"][0]   # it learns


@pytest.mark.parametrize("family", list(FAMILIES) + ["llama_gqa_checkpointed"])
def test_models_logits_and_gradients_equal_whole_sequence(two_ranks, family):
    """GQA, a causal sliding window, softcap + window, sinks + window, gradient checkpointing: every rank's logits are
    its shard of the whole sequence's (eager attention), and the summed gradients the whole sequence's."""
    for result in two_ranks:
        logits_error, grad_error = result["families"][family]
        assert logits_error < 1e-4, logits_error
        assert grad_error < 1e-4, grad_error


def test_refusal_setting_and_gradient_sum_on_every_rank(two_ranks):
    """A mask raises on both ranks (no hang), context_parallel() restores the setting, sum_gradients sums what any
    rank has and leaves None where no rank has a gradient."""
    for result in two_ranks:
        assert result["gradients"] == ([3.0] * 3, [5.0] * 3, None)
        assert result["refusal"] is not None and "attention masks" in result["refusal"]
        assert result["after"] is None   # context_parallel() restored the single-process setting
