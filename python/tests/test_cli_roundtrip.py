"""Plans move between Python and the C command line: Python's samples file → `attnforge plan` → Python, and
Python's plan → `attnforge verify` (the C library runs it against its double reference)."""
import json
import subprocess

import pytest

torch = pytest.importorskip("torch")

import attnforge as af  # noqa: E402
import attnforge.torch as aft  # noqa: E402
from test_torch_helpers import gpt  # noqa: E402


def run(cli, *args):
    return subprocess.run([cli, *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.fixture
def recorded(tmp_path):
    model = gpt(keyword=True)
    samples = aft.record(model, torch.randn(2, 16, 64))
    path = tmp_path / "samples.json"
    samples.save(path)
    return model, samples, path


def test_cli_plan_equals_python_plan(cli, recorded, tmp_path):
    model, samples, samples_path = recorded
    result = run(cli, "plan", samples_path, "-o", tmp_path / "plan.json")
    assert result.returncode == 0, result.stderr
    from_cli = af.FlashAttention4KernelProvider.load(tmp_path / "plan.json")
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare(samples)
    assert from_cli.to_dict() == provider.to_dict()
    x = torch.randn(1, 12, 64)
    with torch.no_grad():
        want = model(x)
        with aft.apply(model, tmp_path / "plan.json"):   # the CLI's plan file, applied as it is
            got = model(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cli_verifies_a_python_plan(cli, recorded, tmp_path):
    _, samples, samples_path = recorded
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare(samples)
    provider.save(tmp_path / "plan.json")
    result = run(cli, "verify", "--plan", tmp_path / "plan.json", "--samples", samples_path, "--threads", "1")
    assert result.returncode == 0, result.stdout + result.stderr


def test_cli_reads_the_seeds_plan_form_written_by_python(cli, recorded, tmp_path):
    _, _, samples_path = recorded
    seed = {"type": "FlashAttention4KernelProvider", "qkv_source": "keyword_qkv",
            "flash_kwargs": {"causal": True, "pack_gqa": False}, "copy_free_layout": True}
    (tmp_path / "seed.json").write_text(json.dumps(seed))
    result = run(cli, "verify", "--plan", tmp_path / "seed.json", "--samples", samples_path, "--threads", "1")
    assert result.returncode == 0, result.stdout + result.stderr


def test_cli_and_python_refuse_alike(cli, tmp_path):
    q = torch.randn(2, 4, 17, 8)
    samples = aft.Samples([((q, q, q), {"dropout_p": 0.1})])
    samples.save(tmp_path / "samples.json")
    result = run(cli, "plan", tmp_path / "samples.json")
    assert result.returncode == 3
    provider = af.FlashAttention4KernelProvider()
    assert not provider.prepare(samples)
    assert provider.reason in result.stderr
