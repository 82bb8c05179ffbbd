"""On a machine with an NVIDIA GPU and attnforge's CUDA backend (skipped elsewhere): torch CUDA tensors through
scaled_dot_product_attention, the provider and apply(), on PyTorch's current stream, against PyTorch's SDPA."""
import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attnforge as af  # noqa: E402
import attnforge.torch as aft  # noqa: E402

CUDA_PLAN = {"type": "FlashAttention4KernelProvider", "version": 1, "qkv_source": "positional_qkv",
             "flash_kwargs": {"causal": True}, "copy_free_layout": True, "backend": "cuda"}


def _backend_ready():
    if not torch.cuda.is_available():
        return "no CUDA device for torch"
    try:
        af.FlashAttention4KernelProvider.from_dict(CUDA_PLAN).load_runtime_dependencies()
    except af.RuntimeUnavailableError as e:
        return f"attnforge's CUDA backend: {e}"
    return None


pytestmark = pytest.mark.skipif(_backend_ready() is not None, reason=str(_backend_ready()))
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4}


def nhd(b, h, n, e, dtype, device="cuda"):
    """(B, H, N, E) HND views of NHD-contiguous memory, as transformers make them."""
    return torch.randn(b, n, h, e, dtype=dtype, device=device).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_pytorch_on_a_side_stream(dtype, is_causal):
    torch.manual_seed(0)
    q, k, v = nhd(2, 8, 77, 64, dtype), nhd(2, 2, 77, 64, dtype), nhd(2, 2, 77, 64, dtype)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):   # attnforge enqueues on the current stream: this one
        out, lse = af.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True, return_lse=True)
    torch.cuda.current_stream().wait_stream(stream)
    assert out.device == q.device and lse.device == q.device and out.dtype == dtype
    torch.testing.assert_close(out, want, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.isfinite(lse).all()


def test_tensors_on_two_devices_are_a_value_error():
    q = nhd(1, 2, 8, 64, torch.float16)
    with pytest.raises(ValueError, match="on cpu but query is on cuda"):
        af.scaled_dot_product_attention(q, q.cpu(), q)


def test_record_prepare_apply_on_cuda():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(256, 3 * 256)

        def forward(self, x):
            B, L, _ = x.shape
            q, k, v = self.qkv(x).view(B, L, 3, 4, 64).unbind(2)
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True)

    torch.manual_seed(0)
    model = Block().to("cuda", torch.bfloat16).eval()
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)
    samples = aft.record(model, x)
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare(samples), provider.reason
    assert provider.to_dict()["backend"] == "cuda"
    with torch.no_grad():
        want = model(x)
        with aft.apply(model, provider):
            got = model(x)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert af._C._testing_stats(provider._c)["plan_calls"] == 1
    cpu_model = Block().to(torch.bfloat16).eval()   # CPU calls under a cuda plan: PyTorch's
    with torch.no_grad(), aft.apply(cpu_model, provider):
        cpu_model(x.cpu())
    assert af._C._testing_stats(provider._c)["plan_calls"] == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("features", ["window", "softcap_sink", "decode_window_sink"])
def test_flash_attn_func_features_match_the_cpu(dtype, features):
    """flash_attn_func on CUDA tensors (the tensor-core kernel for f16/bf16, the CUDA cores for f32) against the
    same call on CPU copies: sliding window, softcap and learned sink, and a decode that splits its keys."""
    torch.manual_seed(1)
    lq, s = (1, 3000) if features.startswith("decode") else (200, 333)
    q = torch.randn(2, lq, 8, 64, dtype=dtype, device="cuda")
    k, v = (torch.randn(2, s, 2, 64, dtype=dtype, device="cuda") for _ in range(2))
    kwargs = {"causal": True, "window_size": (100, 0)} if features != "softcap_sink" else {"softcap": 5.0}
    if "sink" in features:
        kwargs["learnable_sink"] = torch.randn(8, dtype=torch.float32, device="cuda") + 2.0
    out, lse = af.flash_attn_func(q, k, v, return_lse=True, **kwargs)
    cpu = {key: val.cpu() if torch.is_tensor(val) else val for key, val in kwargs.items()}
    want, want_lse = af.flash_attn_func(q.cpu(), k.cpu(), v.cpu(), return_lse=True, **cpu)
    assert out.device == q.device and out.dtype == dtype
    torch.testing.assert_close(out.cpu(), want, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse.cpu(), want_lse, atol=1e-3, rtol=1e-3)


def test_flash_attn_varlen_and_paged_match_the_cpu():
    """Packed sequences and a paged cache on CUDA (the index arrays in device memory) against the CPU."""
    torch.manual_seed(2)
    q = torch.randn(10, 4, 64, dtype=torch.float16, device="cuda")
    k, v = (torch.randn(13, 2, 64, dtype=torch.float16, device="cuda") for _ in range(2))
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 5, 13], dtype=torch.int32, device="cuda")
    got = af.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6, max_seqlen_k=8,
                                    causal=True)[0]
    want = af.flash_attn_varlen_func(q.cpu(), k.cpu(), v.cpu(), cu_seqlens_q=cu_q.cpu(), cu_seqlens_k=cu_k.cpu(),
                                     max_seqlen_q=6, max_seqlen_k=8, causal=True)[0]
    torch.testing.assert_close(got.cpu(), want, atol=3e-3, rtol=3e-3)
    pages = torch.randn(6, 16, 2, 64, dtype=torch.float16, device="cuda")
    table = torch.tensor([[5, 0], [3, 1]], dtype=torch.int32, device="cuda")
    used = torch.tensor([20, 9], dtype=torch.int32, device="cuda")
    qd = torch.randn(2, 1, 4, 64, dtype=torch.float16, device="cuda")
    got = af.flash_attn_varlen_func(qd, pages, pages, page_table=table, seqused_k=used)[0]
    want = af.flash_attn_varlen_func(qd.cpu(), pages.cpu(), pages.cpu(), page_table=table.cpu(),
                                     seqused_k=used.cpu())[0]
    torch.testing.assert_close(got.cpu(), want, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("kernel", ["default", "mma.sync"])
@pytest.mark.parametrize("head_dim,page_size", [(64, 16), (128, 48), (128, 256), (256, 3), (256, 32), (128, None)])
def test_prefill_paths_match_the_cpu(monkeypatch, kernel, head_dim, page_size):
    """Prefill (more than 64 packed rows: on compute capability 9.0 the Hopper kernel by default, its TMA boxes or its
    gathered path by page size; ATTNFORGE_CUDA_WGMMA=0 the mma.sync kernels) for each head-dim variant, paged or
    not, causal, with NaN in every K/V row no sequence reads: against the CPU."""
    monkeypatch.setenv("ATTNFORGE_CUDA_WGMMA", "0" if kernel == "mma.sync" else "1")
    torch.manual_seed(head_dim + (page_size or 0))
    used = [300, 157]
    q = torch.randn(2, 90, 8, head_dim, dtype=torch.bfloat16, device="cuda")
    kwargs = {"causal": True}
    if page_size is None:   # fixed K/V with seqused_k: rows past each sequence's keys are never read
        k, v = (torch.randn(2, 320, 2, head_dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        for b, n in enumerate(used):
            k[b, n:], v[b, n:] = float("nan"), float("nan")
    else:   # pages in random order, the unused ones and the last pages' tails NaN
        slots = [(n + page_size - 1) // page_size for n in used]
        pages = sum(slots) + 1
        k, v = (torch.full((pages, page_size, 2, head_dim), float("nan"), dtype=torch.bfloat16, device="cuda")
                for _ in range(2))
        order = torch.randperm(pages, device="cuda")[:sum(slots)].to(torch.int32)
        table = torch.full((2, max(slots)), -1, dtype=torch.int32, device="cuda")
        table[0, :slots[0]], table[1, :slots[1]] = order[:slots[0]], order[slots[0]:]
        for b, n in enumerate(used):
            for j in range(slots[b]):
                rows = min(page_size, n - j * page_size)
                k[table[b, j], :rows] = torch.randn(rows, 2, head_dim, dtype=torch.bfloat16, device="cuda")
                v[table[b, j], :rows] = torch.randn(rows, 2, head_dim, dtype=torch.bfloat16, device="cuda")
        kwargs["page_table"] = table
    kwargs["seqused_k"] = torch.tensor(used, dtype=torch.int32, device="cuda")
    got, lse = af.flash_attn_varlen_func(q, k, v, return_lse=True, **kwargs)
    cpu = {key: val.cpu() if torch.is_tensor(val) else val for key, val in kwargs.items()}
    want, want_lse = af.flash_attn_varlen_func(q.cpu(), k.cpu(), v.cpu(), return_lse=True, **cpu)
    assert not got.isnan().any()
    torch.testing.assert_close(got.cpu(), want, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
    torch.testing.assert_close(lse.cpu(), want_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_flash_attn_float8_kv_matches_the_cpu(kv_dtype):
    """A float8 K/V cache under an f16 query, with descales, on CUDA (the tensor cores' float8 variants: tiles staged
    as bytes and converted in shared memory) against the same call on the CPU."""
    torch.manual_seed(3)
    q = torch.randn(2, 5, 8, 64, dtype=torch.float16, device="cuda")
    k, v = (torch.randn(2, 300, 2, 64, device="cuda").to(kv_dtype) for _ in range(2))
    descales = {name: torch.rand(2, 2, device="cuda") + 0.5 for name in ("q_descale", "k_descale", "v_descale")}
    got = af.flash_attn_func(q, k, v, causal=True, **descales)[0]
    want = af.flash_attn_func(q.cpu(), k.cpu(), v.cpu(), causal=True,
                              **{name: d.cpu() for name, d in descales.items()})[0]
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.cpu(), want, atol=3e-3, rtol=3e-3)


def test_paged_decode_captured_in_a_cuda_graph_and_replayed():
    """A paged decode reads its page table and seqused_k on the device only (docs/CUDA.md): torch.cuda.graph captures
    it, and a replay after the table, the lengths and the query changed in place matches the CPU."""
    torch.manual_seed(4)
    pages = torch.randn(8, 16, 2, 64, dtype=torch.float16, device="cuda")
    table = torch.tensor([[5, 0, 7], [3, 1, 2]], dtype=torch.int32, device="cuda")
    used = torch.tensor([40, 9], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 1, 4, 64, dtype=torch.float16, device="cuda")
    with torch.no_grad():
        af.flash_attn_varlen_func(q, pages, pages, page_table=table, seqused_k=used)   # warm-up outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = af.flash_attn_varlen_func(q, pages, pages, page_table=table, seqused_k=used)[0]
        table.copy_(torch.tensor([[1, 2, 3], [6, 4, 0]], dtype=torch.int32))   # the next step's cache, in place
        used.copy_(torch.tensor([17, 48], dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
    want = af.flash_attn_varlen_func(q.cpu(), pages.cpu(), pages.cpu(), page_table=table.cpu(),
                                     seqused_k=used.cpu())[0]
    torch.testing.assert_close(out.cpu(), want, atol=3e-3, rtol=3e-3)


def test_a_bad_page_gives_nan_rows_and_is_reported_by_cuda_check_errors():
    """A page index past the pool: the call returns without reading it, its sequence's rows are NaN, the other
    sequence matches the CPU, and attnforge.cuda_check_errors names the entry once."""
    torch.manual_seed(5)
    pages = torch.randn(8, 16, 2, 64, dtype=torch.float16, device="cuda")
    table = torch.tensor([[5, 0, 7], [3, 99, 2]], dtype=torch.int32, device="cuda")   # 99: no such page
    used = torch.tensor([40, 40], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 1, 4, 64, dtype=torch.float16, device="cuda")
    af.cuda_check_errors(q.device)   # nothing pending from earlier tests
    with torch.no_grad():
        out = af.flash_attn_varlen_func(q, pages, pages, page_table=table, seqused_k=used)[0]
    with pytest.raises(af.InvalidArgumentError, match=r"page_table: \[1, 1\] = 99"):
        af.cuda_check_errors(q.device)
    af.cuda_check_errors(q.device)   # cleared by the check that reported it
    assert torch.isnan(out[1].float()).all()
    want = af.flash_attn_varlen_func(q[:1].cpu(), pages.cpu(), pages.cpu(), page_table=table[:1].cpu(),
                                     seqused_k=used[:1].cpu())[0]
    torch.testing.assert_close(out[:1].cpu(), want, atol=3e-3, rtol=3e-3)


def _spy_on_the_caching_allocator(monkeypatch):
    """Every torch.cuda.caching_allocator_alloc/delete call from now on, as ("alloc", nbytes, device, stream, ptr)
    and ("free", ptr); attnforge._tensors.call_workspace reads both at each call."""
    calls = []
    alloc, delete = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete

    def spy_alloc(nbytes, device, stream):
        ptr = alloc(nbytes, device, stream)
        calls.append(("alloc", nbytes, device, stream, ptr))
        return ptr

    def spy_delete(ptr):
        calls.append(("free", ptr))
        delete(ptr)

    monkeypatch.setattr(torch.cuda, "caching_allocator_alloc", spy_alloc)
    monkeypatch.setattr(torch.cuda, "caching_allocator_delete", spy_delete)
    return calls


def test_scratch_comes_from_pytorchs_caching_allocator(monkeypatch):
    """A query the tensor cores cannot read in place (stride[3] = 2) is copied into scratch that PyTorch's caching
    allocator gives, on the call's device and stream, and takes back (docs/CUDA.md, "Workspace")."""
    torch.manual_seed(6)
    q = torch.randn(1, 8, 77, 128, dtype=torch.float16, device="cuda")[..., ::2]
    k, v = nhd(1, 8, 77, 64, torch.float16), nhd(1, 8, 77, 64, torch.float16)
    calls = _spy_on_the_caching_allocator(monkeypatch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        out = af.scaled_dot_product_attention(q, k, v)
    stream.synchronize()
    assert [c[0] for c in calls] == ["alloc", "free"]
    _, nbytes, device, on_stream, ptr = calls[0]
    assert nbytes == 1 * 8 * 77 * 64 * 2 and device == q.device.index and on_stream == stream.cuda_stream
    assert calls[1] == ("free", ptr)
    want = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, want, atol=TOL[torch.float16], rtol=TOL[torch.float16])


def test_scratch_under_a_cuda_graph_comes_from_its_pool(monkeypatch):
    """Captured, the copy's scratch comes from the graph's private pool through the caching allocator (no
    synchronisation, no cudaMalloc), and the replay with new inputs matches."""
    q = torch.randn(1, 8, 128, 128, dtype=torch.float16, device="cuda")[..., ::2]
    k, v = nhd(1, 2, 128, 64, torch.float16), nhd(1, 2, 128, 64, torch.float16)
    with torch.no_grad():
        af.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)   # warm-up outside capture
        torch.cuda.synchronize()
        calls = _spy_on_the_caching_allocator(monkeypatch)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = af.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert [c[0] for c in calls] == ["alloc", "free"]
    torch.testing.assert_close(out, want, atol=TOL[torch.float16], rtol=TOL[torch.float16])


class CausalBlock(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_operator_captured_in_a_cuda_graph_and_replayed():
    """The operator enqueues on the current stream and never synchronises: a torch.cuda.graph captures it."""
    q, k, v = nhd(1, 8, 128, 64, torch.float16), nhd(1, 2, 128, 64, torch.float16), nhd(1, 2, 128, 64, torch.float16)
    with torch.no_grad():
        af.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)   # warm-up outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = af.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        q.copy_(torch.randn_like(q))   # new inputs in the captured buffers
        graph.replay()
        torch.cuda.synchronize()
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, want, atol=TOL[torch.float16], rtol=TOL[torch.float16])


def test_compile_reduce_overhead_under_apply():
    """torch.compile(mode="reduce-overhead") (CUDA graphs) with the plan's operator in the graph."""
    q, k, v = nhd(1, 8, 128, 64, torch.float16), nhd(1, 2, 128, 64, torch.float16), nhd(1, 2, 128, 64, torch.float16)
    module = CausalBlock()
    provider = af.FlashAttention4KernelProvider(backend="attnforge")
    assert provider.prepare(aft.record(module, q, k, v))
    torch._dynamo.reset()
    with torch.no_grad(), aft.apply(module, provider):
        compiled = torch.compile(module, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):   # warm-up runs, then the recorded graph replays
            got = compiled(q, k, v).clone()
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got, want, atol=TOL[torch.float16], rtol=TOL[torch.float16])


def test_two_streams_at_once_match_one_at_a_time():
    """A prefill (128-row blocks) on one stream and a split-KV decode (its partials in scratch) on another, enqueued
    with no order between them, three times over: each gives the bits it gives alone (the scratch of one call is
    never the other's, and nothing in a call synchronises)."""
    torch.manual_seed(6)
    q1, k1, v1 = nhd(1, 16, 1024, 128, torch.bfloat16), nhd(1, 4, 1024, 128, torch.bfloat16), \
        nhd(1, 4, 1024, 128, torch.bfloat16)
    q2, k2, v2 = nhd(2, 8, 1, 64, torch.float16), nhd(2, 2, 4096, 64, torch.float16), \
        nhd(2, 2, 4096, 64, torch.float16)
    alone1 = af.scaled_dot_product_attention(q1, k1, v1, is_causal=True, enable_gqa=True)
    alone2 = af.scaled_dot_product_attention(q2, k2, v2, enable_gqa=True)
    torch.cuda.synchronize()
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    got = []
    for _ in range(3):
        with torch.cuda.stream(streams[0]):
            got.append((0, af.scaled_dot_product_attention(q1, k1, v1, is_causal=True, enable_gqa=True)))
        with torch.cuda.stream(streams[1]):
            got.append((1, af.scaled_dot_product_attention(q2, k2, v2, enable_gqa=True)))
    torch.cuda.synchronize()
    for which, out in got:
        assert torch.equal(out, (alone1, alone2)[which])
    torch.testing.assert_close(alone1, F.scaled_dot_product_attention(q1, k1, v1, is_causal=True, enable_gqa=True),
                               atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
