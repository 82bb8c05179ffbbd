"""The README's ten-line example runs as written (record, prepare, save, load, apply), and so does its compile and
export block after it, with attnforge's operators in both graphs."""
import pathlib
import re

import pytest

torch = pytest.importorskip("torch")

from test_torch_helpers import GPT as _GPT  # noqa: E402

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example(tmp_path, monkeypatch):
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Python and PyTorch"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 12
    monkeypatch.chdir(tmp_path)
    namespace = {"GPT": lambda: _GPT(dim=512, heads=8, kv_heads=8)}
    torch.manual_seed(0)
    exec(compile(code, str(README), "exec"), namespace)
    model, y = namespace["model"], namespace["y"]
    assert (tmp_path / "plan.json").exists() and (tmp_path / "samples.json").exists()
    torch.manual_seed(1)
    x = torch.randn(4, 128, 512)
    with torch.no_grad():
        want = model(x)
        import attnforge.torch as aft
        with aft.apply(model, namespace["plan"]):
            got = model(x)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert y.shape == (4, 128, 512)


def test_readme_compile_and_export_block(tmp_path, monkeypatch):
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Python and PyTorch"):]
    first, second = re.findall(r"```python\n(.*?)```", section, re.S)[:2]
    assert "torch.compile" in second and "torch.export" in second
    monkeypatch.chdir(tmp_path)
    namespace = {"GPT": lambda: _GPT(dim=512, heads=8, kv_heads=8)}
    torch.manual_seed(0)
    torch._dynamo.reset()
    exec(compile(first + second, str(README), "exec"), namespace)
    program = namespace["program"]
    assert [str(n.target) for n in program.graph.nodes].count("attnforge.provider_sdpa.default") == 2
    assert namespace["y"].shape == (4, 100, 512)
    torch._dynamo.reset()
