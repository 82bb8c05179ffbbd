"""attnforge against vLLM's CPU attention, side by side in one process (issue 46, part 2).

vLLM's CPU backend runs prefill, decode, chunked prefill and mixed batches through one op,
torch.ops._C.cpu_attention_with_kv_cache, over its paged cache (num_blocks, Hkv, block_size, E) written by
cpu_attn_reshape_and_cache. attnforge runs the same sequences through flash_attn_varlen_func over FA4-layout pages
(num_pages, page_size, Hkv, E) holding the same values under the same shuffled page table, and, for prefill, also
over contiguous K/V (flash_attn_func). Both outputs are first checked against each other and against PyTorch's math
SDPA; then each case times loops of the two libraries alternately (each loop ~0.3 s) and reports medians.

Decode rows cycle through enough copies of the cache (like the layers of a model) that K/V come from DRAM; "hot"
rows reuse one copy. GB/s = bytes of K+V read / time; GFLOP/s = 4·Hq·E·(keys seen by all query rows) / time.

vLLM's CPU wheels pin a "+cpu" torch that only PyTorch's own index has; bench/vllm_env.sh builds a venv with
PyPI's torch of the same version and the wheel installed --no-deps (../shared/research/peer-vllm.md, section 1).
Run:   bash bench/vllm_env.sh && build-vllm/venv/bin/python bench/vllm_compare.py [--quick] [--json]
Where vLLM does not import, this prints why and exits 0 (skipped).
"""
import argparse
import json
import math
import sys

import torch

from _timing import timed_loops


def load_vllm():
    """vllm._custom_ops, or None and the reason it cannot run here."""
    try:
        import vllm._custom_ops as ops   # loads vllm._C (the AVX512-BF16 build where torch reports it)
    except Exception as exc:   # ImportError, or an undefined symbol against this torch
        return None, f"{type(exc).__name__}: {exc}"
    if not hasattr(ops, "cpu_attention_with_kv_cache"):
        return None, "this vLLM has no cpu_attention_with_kv_cache (CPU attention op of vLLM >= 0.30)"
    return ops, None


class Case:
    """Sequences (query rows, keys) over one paged cache, in both libraries' layouts."""

    def __init__(self, name, dtype, q_lens, k_lens, Hq=32, Hkv=8, E=128, page=128, copies=1, seed=0):
        self.name, self.dtype, self.Hq, self.Hkv, self.E, self.page = name, dtype, Hq, Hkv, E, page
        g = torch.Generator().manual_seed(seed)
        self.q_lens, self.k_lens = q_lens, k_lens
        self.B = len(q_lens)
        self.q = torch.randn(sum(q_lens), Hq, E, generator=g).to(dtype)
        self.keys = [torch.randn(s, Hkv, E, generator=g).to(dtype) for s in k_lens]
        self.values = [torch.randn(s, Hkv, E, generator=g).to(dtype) for s in k_lens]
        self.qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
        self.seq_lens = torch.tensor(k_lens, dtype=torch.int32)
        pages_per = [-(-s // page) for s in k_lens]
        self.max_pages = max(pages_per)
        self.num_pages = sum(pages_per) + 1
        order = torch.randperm(self.num_pages, generator=g)
        self.table = torch.zeros(self.B, self.max_pages, dtype=torch.int32)
        at = 0
        for b, n in enumerate(pages_per):
            self.table[b, :n] = order[at:at + n].to(torch.int32)
            at += n
        self.copies = copies
        self.scale = 1.0 / math.sqrt(E)

    def attnforge_pages(self):
        """(num_pages, page, Hkv, E) K and V, `copies` of them."""
        out = []
        for _ in range(self.copies):
            k = torch.zeros(self.num_pages, self.page, self.Hkv, self.E, dtype=self.dtype)
            v = torch.zeros_like(k)
            for b in range(self.B):
                for p in range(-(-self.k_lens[b] // self.page)):
                    rows = slice(p * self.page, min((p + 1) * self.page, self.k_lens[b]))
                    n = rows.stop - rows.start
                    k[self.table[b, p], :n] = self.keys[b][rows]
                    v[self.table[b, p], :n] = self.values[b][rows]
            out.append((k, v))
        return out

    def vllm_caches(self, ops, isa):
        """vLLM's caches, written by its own op (the in-block layout depends on the ISA), `copies` of them."""
        out = []
        for _ in range(self.copies):
            kv = torch.zeros(self.num_pages, self.Hkv, self.page, 2 * self.E, dtype=self.dtype)
            key_cache, value_cache = kv.view(self.num_pages, self.Hkv, 2 * self.page, self.E).chunk(2, dim=2)
            for b in range(self.B):
                pos = torch.arange(self.k_lens[b])
                slots = self.table[b, pos // self.page].long() * self.page + pos % self.page
                ops.cpu_attn_reshape_and_cache(self.keys[b], self.values[b], key_cache, value_cache, slots, isa)
            out.append((key_cache, value_cache))
        return out

    def reference(self):
        """PyTorch's math SDPA per sequence in float32, bottom-right causal, GQA by repeating K/V heads."""
        outs, at = [], 0
        G = self.Hq // self.Hkv
        for b in range(self.B):
            L, S = self.q_lens[b], self.k_lens[b]
            q = self.q[at:at + L].float().transpose(0, 1)
            k = self.keys[b].float().repeat_interleave(G, dim=1).transpose(0, 1)
            v = self.values[b].float().repeat_interleave(G, dim=1).transpose(0, 1)
            mask = torch.ones(L, S, dtype=torch.bool).tril(S - L)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            outs.append(o.transpose(0, 1))
            at += L
        return torch.cat(outs)

    def keys_seen(self):
        return sum(sum(min(S, S - L + i + 1) for i in range(L)) for L, S in zip(self.q_lens, self.k_lens))

    def kv_bytes(self):
        return 2 * sum(self.k_lens) * self.Hkv * self.E * self.q.element_size()


def run_case(ops, attnforge, case, repeats):
    isa = "vec" if case.page % 32 == 0 else "vec16"
    caches = case.vllm_caches(ops, isa)
    pages = case.attnforge_pages()
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=case.B, num_heads=case.Hq, num_kv_heads=case.Hkv, head_dim=case.E, seq_lens=case.seq_lens,
        dtype=case.dtype, query_start_loc=case.qsl, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=True)
    out = torch.empty(case.q.shape[0], case.Hq, case.E, dtype=case.dtype)
    state = {"v": 0, "a": 0}

    def vllm_call():
        kc, vc = caches[state["v"] % len(caches)]
        state["v"] += 1
        ops.cpu_attention_with_kv_cache(
            query=case.q, key_cache=kc, value_cache=vc, output=out, query_start_loc=case.qsl,
            seq_lens=case.seq_lens, scale=case.scale, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=case.table, softcap=0.0, scheduler_metadata=sched, s_aux=None)
        return out

    max_q, max_k = max(case.q_lens), max(case.k_lens)

    def attnforge_call():
        k, v = pages[state["a"] % len(pages)]
        state["a"] += 1
        o, _ = attnforge.flash_attn_varlen_func(
            case.q, k, v, cu_seqlens_q=case.qsl, max_seqlen_q=max_q, max_seqlen_k=max_k, page_table=case.table,
            seqused_k=case.seq_lens, softmax_scale=case.scale, causal=True)
        return o

    ref = case.reference()
    err_v = (vllm_call().float() - ref).abs().max().item()
    err_a = (attnforge_call().float() - ref).abs().max().item()
    bound = 2e-2 if case.dtype == torch.bfloat16 else 2e-5
    if not (err_v < bound and err_a < bound):
        raise SystemExit(f"{case.name}: outputs disagree with PyTorch's math SDPA (vLLM {err_v:.2e}, attnforge "
                         f"{err_a:.2e}, bound {bound:.0e})")
    fns = [vllm_call, attnforge_call]
    contiguous = None
    if case.B == 1 and case.q_lens[0] > 1:   # prefill: attnforge over contiguous K/V as well
        k4, v4 = case.keys[0][None], case.values[0][None]
        q4 = case.q[None]

        def contiguous():
            return attnforge.flash_attn_func(q4, k4, v4, softmax_scale=case.scale, causal=True)
        fns.append(contiguous)
    times = timed_loops(fns, repeats=repeats)
    row = {"case": case.name, "dtype": str(case.dtype).replace("torch.", ""), "page": case.page, "isa_vllm": isa,
           "vllm_ms": times[0] * 1e3, "attnforge_ms": times[1] * 1e3, "ratio": times[0] / times[1],
           "err_vllm": err_v, "err_attnforge": err_a}
    flops = 4.0 * case.Hq * case.E * case.keys_seen()
    row["vllm_gflops"], row["attnforge_gflops"] = flops / times[0] / 1e9, flops / times[1] / 1e9
    if max_q == 1:
        row["vllm_gbps"], row["attnforge_gbps"] = case.kv_bytes() / times[0] / 1e9, case.kv_bytes() / times[1] / 1e9
    if contiguous is not None:
        row["attnforge_contiguous_ms"] = times[2] * 1e3
        row["ratio_contiguous"] = times[0] / times[2]
    return row


def cases(quick):
    """The rows of ../shared/research/peer-vllm.md section 6: decode, prefill and a mixed batch; and a small call."""
    out = []
    dram = 96 << 20   # three times a 32 MiB L3: cycle cache copies until a pass reads more than this

    def copies(k_lens, Hkv=8, E=128, elem=2):
        return max(1, -(-dram // (2 * sum(k_lens) * Hkv * E * elem)))
    for dt, elem in ((torch.bfloat16, 2), (torch.float32, 4)):
        name = "bf16" if dt == torch.bfloat16 else "f32"
        out.append(Case(f"decode B1 ctx4096 {name}", dt, [1], [4096], copies=copies([4096], elem=elem)))
        out.append(Case(f"decode B8 ctx32768 {name}", dt, [1] * 8, [32768] * 8, copies=1))
        if not quick:
            out.append(Case(f"decode B8 ctx4096 {name}", dt, [1] * 8, [4096] * 8, copies=copies([4096] * 8, elem=elem)))
        out.append(Case(f"prefill L2048 {name}", dt, [2048], [2048]))
        if not quick:
            out.append(Case(f"prefill L4096 {name}", dt, [4096], [4096]))
            out.append(Case(f"prefill L2048 16/16 E64 {name}", dt, [2048], [2048], Hq=16, Hkv=16, E=64))
        out.append(Case(f"mixed 512+7 {name}", dt, [512] + [1] * 7, [4096] * 8))
        out.append(Case(f"small call B1 ctx128 hot {name}", dt, [1], [128]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rows and repeats")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)   # before any scheduling: vLLM's metadata records the count
    ops, why = load_vllm()
    if ops is None:
        print(f"vllm_compare: skipped: vLLM's CPU attention does not load here ({why})")
        return 0
    import attnforge
    import vllm
    print(f"vllm {vllm.__version__}, torch {torch.__version__}, attnforge {attnforge.__version__} "
          f"({attnforge.get_isa()}), {args.threads} threads", file=sys.stderr)
    header = f"{'case':34} {'page':>4} {'vLLM ms':>9} {'attnforge':>9} {'ratio':>6} {'GB/s v/a':>13} {'contig ms':>9} {'ratio':>6}"
    if not args.json:
        print(header)
    for case in cases(args.quick):
        row = run_case(ops, attnforge, case, repeats=5 if args.quick else 7)
        if args.json:
            print(json.dumps(row))
            continue
        gbps = f"{row['vllm_gbps']:.1f}/{row['attnforge_gbps']:.1f}" if "vllm_gbps" in row else ""
        contig = (f"{row['attnforge_contiguous_ms']:9.2f} {row['ratio_contiguous']:6.2f}"
                  if "attnforge_contiguous_ms" in row else "")
        print(f"{row['case']:34} {row['page']:>4} {row['vllm_ms']:9.3f} {row['attnforge_ms']:9.3f} "
              f"{row['ratio']:6.2f} {gbps:>13} {contig}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
