"""What AITune's users see with attnforge on a GPU: AITune's own KernelSelectorBackend (its real
ModuleFunctionKernelProfiler, KernelUtils timing with triton's do_bench, TorchInductorJitBackend delegate) with its
default attention providers plus attnforge's AttnforgeKernelProvider, on the small GQA model of aitune_harness.
Prints the table of what AITune picked with the latencies it measured, the plan, and checks the built backend's
output against eager PyTorch.

    python python/tests/gpu_aitune_table.py                      # CUDA: float16, 2 layers, 1 x 1024 tokens
    python python/tests/gpu_aitune_table.py --dtype bfloat16 --tokens 4096
    python python/tests/gpu_aitune_table.py --cpu-smoke          # no GPU: the same plumbing on the CPU, with the
                                                                 # tests' CPU profiler/timer and an eager delegate

Exit status: 0 done, 1 failed, 77 skipped (no CUDA, and --cpu-smoke not given).
"""
import argparse
import json
import logging
import pathlib
import sys
import tempfile

import torch

SKIP = 77


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="float16")
    parser.add_argument("--tokens", type=int, default=1024, help="sequence length of the one sample (default 1024)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run on the CPU with the tests' CPU profiler and timer and TorchEagerBackend")
    return parser.parse_args(argv)


def record_latencies(kernel_utils_class, harness):
    """Keep what AITune's own benchmark_function measures, labelled as the CPU timer labels it."""
    measured = []
    original = kernel_utils_class.benchmark_function

    def benchmark_function(self, function, samples, *args, **kwargs):
        latency = original(self, function, samples, *args, **kwargs)
        measured.append((harness._label(function), latency))
        return latency

    kernel_utils_class.benchmark_function = benchmark_function
    return measured


def build_backend(harness, model, x, cpu_utils, cache_dir):
    """KernelSelectorBackend over the default providers plus attnforge's, built like AITune builds it; with
    cpu_utils (a CpuKernelUtils), on the CPU with the tests' profiler and that timer, and an eager delegate."""
    from aitune.torch.backend.kernel_selector_backend import (KernelSelectorBackend, KernelSelectorBackendConfig,
                                                              _default_kernel_providers)
    from aitune.torch.backend.torch_eager import TorchEagerBackend
    from aitune.torch.backend.torch_inductor_jit_backend import TorchInductorJitBackend
    from aitune.torch.module.forward_signature import ForwardSignature
    from aitune.torch.module.graph_spec import GraphSpec
    from aitune.torch.module.sample_metadata import SampleMetadata
    from aitune.torch.module.sample_store import SampleStore
    from attnforge.aitune import AttnforgeKernelProvider

    config = KernelSelectorBackendConfig(kernel_providers=[*_default_kernel_providers(), AttnforgeKernelProvider()])
    selector_class = KernelSelectorBackend
    if cpu_utils is not None:
        class CpuKernelSelectorBackend(KernelSelectorBackend):   # the tests' CPU profiler and timer injected
            _build_mode = KernelSelectorBackend._build_mode   # AITune's Backend asks each class to say them
            _execution_modes = KernelSelectorBackend._execution_modes

            def _create_optimizer(self):
                return harness.cpu_optimizer(self._config.kernel_providers, cpu_utils)[0]
        selector_class = CpuKernelSelectorBackend
    delegate = TorchEagerBackend() if cpu_utils is not None else TorchInductorJitBackend()
    backend = selector_class(config, delegate_backend=delegate)
    with torch.no_grad():
        output = model(x)
    graph_spec = GraphSpec(name="0", input_spec=SampleMetadata.from_inputs({"x": x}),
                           output_spec=SampleMetadata.from_outputs(output),
                           forward_signature=ForwardSignature.from_callable(model.forward))
    samples = SampleStore.from_samples([((x,), {})], cache_dir, "samples")
    (cache_dir / "backend").mkdir()   # AITune's tuner makes each backend's folder before building
    return backend.build(model, graph_spec, samples, x.device, cache_dir / "backend"), output


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("gpu_aitune_table: skipped: no CUDA device (torch.cuda.is_available() is False)")
        return SKIP
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("aitune.torch.kernel_forge.kernel_optimizer").setLevel(logging.INFO)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import aitune_harness as harness   # imports AITune's kernel_forge (normally, or without TensorRT)

    device = "cpu" if args.cpu_smoke else "cuda"
    dtype = getattr(torch, args.dtype)
    cpu_utils = harness.CpuKernelUtils() if args.cpu_smoke else None
    if cpu_utils is not None:
        measurements = cpu_utils.measurements
    else:   # AITune's own timer, observed
        measurements = record_latencies(harness.kernel_utils.KernelUtils, harness)
    model, x = harness.tiny_model(device=device, dtype=dtype, tokens=args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        backend, eager = build_backend(harness, model, x, cpu_utils, pathlib.Path(tmp))
        with torch.no_grad():
            got = backend.infer(x)
        plan = backend._runtime.plan   # a JIT delegate keeps the runtime, and with it the plan
        print(harness.format_table(harness.selection_rows(measurements, plan),
                                   f"AITune KernelSelectorBackend on {_device_name(device)}, {args.dtype}, "
                                   f"1 x {args.tokens} tokens, GQA 8/2 heads of 32:"))
        print("plan:", json.dumps(plan.to_dict()))
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got, eager, atol=tolerance, rtol=tolerance)
        print(f"output matches eager PyTorch (atol = rtol = {tolerance})")
    return 0


def _device_name(device):
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


if __name__ == "__main__":
    sys.exit(main())
