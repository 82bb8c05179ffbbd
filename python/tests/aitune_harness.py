"""What attnforge's AITune tests need around AITune 0.6.0 from PyPI (test_aitune.py, gpu_aitune_table.py):

- AITune's kernel_forge, imported the normal way or, where aitune.torch's package __init__ cannot import (no
  TensorRT), with attnforge.aitune.load_aitune(kernel_forge_only=True); every class used is AITune's own;
- CpuModuleFunctionKernelProfiler and CpuKernelUtils: AITune's KernelOptimizer takes its profiler and its timer as
  constructor parameters (kernel_profiler_factory, kernel_utils), and AITune's own need CUDA; these subclass them
  and change only what needs CUDA;
- a small model (two pre-norm transformer blocks with grouped-query attention calling F.scaled_dot_product_attention)
  and the table of what the optimizer picked, with the latencies it measured.
"""
import statistics
import time

import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F

import attnforge.aitune as af_aitune

kernel_provider = af_aitune.load_aitune(kernel_forge_only=True)

from aitune.torch.kernel_forge import kernel_optimizer, kernel_utils  # noqa: E402  (after load_aitune)
from aitune.torch.kernel_forge import module_function_kernel_profiler as profiler_module  # noqa: E402
from aitune.torch.kernel_forge.kernel_optimization_plan import KernelOptimizationPlan  # noqa: E402,F401
from aitune.torch.kernel_forge.kernel_provider_runtime import KernelProviderRuntime  # noqa: E402,F401

KernelOptimizer = kernel_optimizer.KernelOptimizer
BASELINE = "PyTorch scaled_dot_product_attention (baseline)"


# ---- CPU profiler and timer for AITune's KernelOptimizer
class CpuModuleFunctionKernelProfiler(profiler_module.ModuleFunctionKernelProfiler):
    """AITune's profiler without CUDA: its own wrappers of module forwards and torch.nn.functional calls (which
    collect the distinct samples and their counts), one warmup pass, then one pass under the CPU profiler where each
    ATen op's self CPU time stands for the CUDA kernel time AITune attributes to the enclosing function."""

    def profile(self, function, data=None, *, module=None, warmup_iterations=1):
        if module is None and isinstance(function, nn.Module):
            module = function
        if module is None:
            raise ValueError("module must be provided when function is not an nn.Module.")
        named_modules = list(module.named_modules())
        with torch.no_grad():
            for _ in range(warmup_iterations):
                self._run_inference(function, data)
        self._initialize()
        with self._record_module_forwards(named_modules), self._record_functional_calls():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, torch.no_grad():
                self._run_inference(function, data)
        rows, function_data = self._match_events_with_data(prof.profiler.function_events, named_modules)
        columns = tuple(profiler_module._ProfilingItem.__annotations__)
        return (pd.DataFrame(rows) if rows else pd.DataFrame(columns=columns)), function_data

    def _match_events_with_data(self, function_events, named_modules):
        """AITune's attribution (nearest module and function labels above an op), with CPU ops for kernels."""
        modules = dict(named_modules)
        rows, matched = [], set()
        for event in function_events:
            if "::" not in event.key:   # AITune's own labels and Python frames are not ops
                continue
            module_name = profiler_module._nearest_parent_label(event, profiler_module.MODULE_PREFIX)
            function_name = profiler_module._nearest_parent_label(event, profiler_module.FUNCTIONAL_PREFIX)
            if module_name is None or function_name is None:
                continue
            if self._collects_function_data(function_name):
                matched.add(function_name)
            rows.append({"module_name": module_name, "module": modules[module_name], "function_name": function_name,
                         "op": event.key, "kernel": event.key, "kernel_us": float(event.self_cpu_time_total)})
        return rows, {name: self._rewrite_func_data(name) for name in matched}


class CpuKernelUtils(kernel_utils.KernelUtils):
    """AITune's KernelUtils with a CPU timer. validate_function is AITune's own; benchmark_function times the
    sample loop with time.perf_counter (triton's do_bench needs CUDA), reading warmup and repeats as do_bench does,
    as milliseconds to spend, and returns the median by default (steadier than the mean on a shared machine). Every
    measurement is kept in `measurements` as (label, milliseconds): the provider's name, or BASELINE."""

    def __init__(self, min_runs: int = 5):
        self.min_runs = min_runs
        self.measurements = []

    def benchmark_function(self, function, samples, return_mode="median", warmup=25, repeats=100):
        def run():
            for args, kwargs in samples:
                function(*args, **kwargs)

        with torch.no_grad():
            _spend(run, warmup / 1e3, 1)
            times = _spend(run, repeats / 1e3, self.min_runs)
        latency = _summary(times, return_mode)
        self.measurements.append((_label(function), latency))
        return latency


def _spend(run, seconds, min_runs):
    """Run until `seconds` have passed and at least min_runs times; each run's milliseconds."""
    times, start = [], time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _summary(times, return_mode):
    modes = {"min": min, "max": max, "mean": statistics.fmean, "median": statistics.median, "all": list}
    if return_mode not in modes:
        raise ValueError(f"benchmark_function: return_mode must be one of {sorted(modes)}, got {return_mode!r}")
    return modes[return_mode](times)


def _label(function):
    return str(function) if isinstance(function, kernel_provider.KernelProvider) else BASELINE


def cpu_optimizer(providers, kernel_utils=None):
    """AITune's KernelOptimizer with the CPU profiler and timer injected; (optimizer, its CpuKernelUtils)."""
    utils = kernel_utils if kernel_utils is not None else CpuKernelUtils()
    optimizer = KernelOptimizer(kernel_providers=providers, kernel_profiler_factory=CpuModuleFunctionKernelProfiler,
                                kernel_utils=utils)
    return optimizer, utils


# ---- what the optimizer picked
def selection_rows(measurements, plan):
    """(candidate, latency ms, speed-up over the baseline, picked) per measured candidate, fastest first, then the
    baseline (its last measurement: the optimizer measures it once per function, after the candidates)."""
    baseline = [ms for label, ms in measurements if label == BASELINE][-1]
    picked = {str(p) for p in plan.providers}
    candidates = sorted(((label, ms) for label, ms in measurements if label != BASELINE), key=lambda row: row[1])
    rows = [(label, ms, baseline / ms, label in picked) for label, ms in candidates]
    return rows + [(BASELINE, baseline, 1.0, not picked)]


def format_table(rows, title):
    width = max(len(row[0]) for row in rows)
    lines = [title, f"{'candidate':<{width}}  {'latency [ms]':>12}  {'vs baseline':>11}  picked"]
    for label, ms, speedup, picked in rows:
        lines.append(f"{label:<{width}}  {ms:12.3f}  {speedup:10.2f}x  {'yes' if picked else ''}")
    return "\n".join(lines)


# ---- the model
class GQABlock(nn.Module):
    """Pre-norm transformer block: grouped-query self-attention (heads query heads over kv_heads key/value heads),
    causal, then an MLP. With mask=True causality comes as a boolean (L, L) mask instead of is_causal."""

    def __init__(self, dim=256, heads=8, kv_heads=2, mask=False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.mask = mask
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        batch, length, _ = x.shape
        e = self.head_dim
        q, k, v = self.qkv(self.norm1(x)).split([self.heads * e, self.kv_heads * e, self.kv_heads * e], dim=-1)
        q = q.view(batch, length, self.heads, e).transpose(1, 2)
        k = k.view(batch, length, self.kv_heads, e).transpose(1, 2)
        v = v.view(batch, length, self.kv_heads, e).transpose(1, 2)
        if self.mask:   # the causal mask as a boolean tensor: the same attention, through a mask the C plan refuses
            keep = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(a.transpose(1, 2).reshape(batch, length, self.heads * e))
        return x + self.mlp(self.norm2(x))


class TinyGQATransformer(nn.Module):
    def __init__(self, layers=2, **block):
        super().__init__()
        self.blocks = nn.ModuleList(GQABlock(**block) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def tiny_model(seed=0, device="cpu", dtype=torch.float32, tokens=128, **block):
    """The model in eval mode with fixed weights, and one input (batch 1, `tokens` tokens of width 256)."""
    torch.manual_seed(seed)
    model = TinyGQATransformer(**block).to(device=device, dtype=dtype).eval()
    x = torch.randn(1, tokens, 256, device=device, dtype=dtype)
    return model, x
