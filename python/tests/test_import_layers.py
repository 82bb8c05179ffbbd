"""attnforge's Python package walks one way down (issue 38, docs DESIGN.md's front-end row): public function →
operator (_ops) → the modules that allocate outputs and call the C extension. Read from the sources with ast, every
import counted, those inside functions too: no import cycle, and nothing below the operators imports an operator,
a public module or an integration. Needs neither the built extension nor torch."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "attnforge"

# above the operators: the framework integrations and the package's entry points
INTEGRATIONS = {"__init__", "__main__", "torch", "torch_attention", "transformers", "aitune", "_register",
                "_host_threads", "_diagnostics"}
# the public functions and classes (route torch tensors to the operators)
PUBLIC = {"_sdpa", "_flash", "provider"}
OPERATORS = {"_ops"}
# what the operators' kernels call: outputs allocated, C called
BELOW = {"_sdpa_call", "_flash_call", "_provider_call", "_backward", "_masked_rows", "_tensors", "_guard", "_fa4",
         "_samples", "_mod_trace"}


def _modules():
    return {path.stem: path for path in sorted(PACKAGE.glob("*.py"))}


def _target(name, modules):
    """The package module an import of attnforge.<name> (or attnforge itself: "") loads; None for _C."""
    head = name.split(".")[0] if name else ""
    if head == "":
        return "__init__"
    if head in modules:
        return head
    return None if head == "_C" else "__init__"   # an attribute of the package: its __init__


def imports(path, modules):
    """The package modules `path` imports, anywhere in it (module level, functions, classes)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and not (node.module == "attnforge" or (node.module or "").startswith("attnforge.")):
                continue
            base = (node.module or "") if node.level else (node.module or "")[len("attnforge") + 1:]
            if node.level > 1:
                raise AssertionError(f"{path.name}: an import above the package ({'.' * node.level}{base})")
            if base:
                found.add(_target(base, modules))
            else:   # from . import a, b  /  from attnforge import a, b
                found.update(_target(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "attnforge" or alias.name.startswith("attnforge."):
                    found.add(_target(alias.name[len("attnforge") + 1:], modules))
    found.discard(None)
    found.discard(path.stem)
    return found


def graph():
    modules = _modules()
    return {name: imports(path, modules) for name, path in modules.items()}


def cycles(edges):
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_reads_function_level_imports():
    edges = graph()
    assert "_ops" in edges["_sdpa"]       # scaled_dot_product_attention's import inside the function
    assert "torch_attention" in edges["_register"]


def test_every_module_has_a_layer():
    assert set(_modules()) == INTEGRATIONS | PUBLIC | OPERATORS | BELOW


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_the_operators_import_only_what_is_below_them():
    edges = graph()
    for name in OPERATORS:
        assert edges[name] <= BELOW, f"{name} imports {sorted(edges[name] - BELOW)}"


def test_below_the_operators_nothing_imports_upward():
    edges = graph()
    for name in sorted(BELOW & set(edges)):
        assert edges[name] <= BELOW, f"{name} imports {sorted(edges[name] - BELOW)}"


def test_the_public_modules_import_no_integration():
    edges = graph()
    for name in PUBLIC:
        assert not edges[name] & INTEGRATIONS, f"{name} imports {sorted(edges[name] & INTEGRATIONS)}"


# attnforge.distributed: a front end of its own, written on the public functions and what is below the operators;
# its Transformers integration alone may import the package's Transformers backend. Nothing outside it imports it.
DISTRIBUTED = PACKAGE / "distributed"
DISTRIBUTED_INTEGRATIONS = {"transformers", "__init__"}


def _subpackage_imports(path):
    """(parent package modules, sibling modules) a module of a subpackage (distributed, flex) imports, anywhere in it."""
    parents, siblings = set(), set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        names = [node.module.split(".")[0]] if node.module else [alias.name for alias in node.names]
        if node.level == 2:
            parents.update(names)
        elif node.level == 1:
            siblings.update(names)
        elif node.level == 0 and (node.module or "").startswith("attnforge.distributed."):
            siblings.add(node.module.split(".")[2])
    return parents, siblings


def test_distributed_walks_one_way_down():
    modules = {p.stem: p for p in sorted(DISTRIBUTED.glob("*.py"))}
    assert {"_ring", "_comm", "_merge", "ring", "llama3", "ulysses", "decode"} <= set(modules)
    edges = {}
    for name, path in modules.items():
        parents, siblings = _subpackage_imports(path)
        allowed = PUBLIC | BELOW | {"_C"} | ({"transformers"} if name in DISTRIBUTED_INTEGRATIONS else set())
        assert parents <= allowed, f"distributed/{name} imports {sorted(parents - allowed)} from the package"
        edges[name] = siblings & set(modules)
    assert cycles(edges) == []
    for name, path in _modules().items():   # the package's own modules never reach up into distributed
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ImportFrom):
                target = (node.module or "") if node.level else (node.module or "")[len("attnforge."):]
                named = [alias.name for alias in node.names] if not node.module else []
                assert not target.startswith("distributed") and "distributed" not in named, name
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("attnforge.distributed") for a in node.names), name


# attnforge.flex: a front end of its own over the C extension (and what is below the operators: the mods' tracer,
# _mod_trace, which flash_attn_func's mods use too); only the package's entry point (lazily: attnforge.flex_attention,
# so importing attnforge never imports torch through it) and the framework integrations above it reach it.
FLEX = PACKAGE / "flex"


def test_flex_walks_one_way_down():
    modules = {p.stem: p for p in sorted(FLEX.glob("*.py"))}
    assert {"__init__", "_block_mask", "_builtin"} <= set(modules)
    edges = {}
    for name, path in modules.items():
        parents, siblings = _subpackage_imports(path)
        assert parents <= BELOW | {"_C"}, f"flex/{name} imports {sorted(parents - BELOW - {'_C'})} from the package"
        edges[name] = siblings & set(modules)
    assert cycles(edges) == []
    for name, path in _modules().items():
        if name in INTEGRATIONS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ImportFrom):
                target = (node.module or "") if node.level else (node.module or "")[len("attnforge."):]
                named = [alias.name for alias in node.names] if not node.module else []
                assert not target.startswith("flex") and "flex" not in named, name
