"""Layers only go down: no import cycles, and the low modules load nothing above them."""
import ast
import os
import subprocess
import sys

from conftest import REPO

PACKAGE = REPO / "llmctl"


def _module_name(path):
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(name):
    """The llmctl modules a module's source imports, anywhere in it (a function-level import
    counts: it is a dependency all the same). `from pkg import name` counts as pkg.name when that
    is a module, else as pkg."""
    out = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("llmctl"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in MODULES else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("llmctl"))
    return {m for m in out if m in MODULES and m != name}


def _cycles(graph):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_llmctl_imports_one_that_imports_it_back():
    assert _cycles({m: imports(m) for m in MODULES}) == []


def test_the_file_format_module_imports_only_the_shape_table_of_the_model():
    assert imports("llmctl.formats") <= {"llmctl.atomic", "llmctl.errors", "llmctl.constants",
                                         "llmctl.model.config"}
    assert imports("llmctl.model.config") <= {"llmctl.errors", "llmctl.constants"}
    assert imports("llmctl.errors") == set()


def test_the_default_locations_download_nothing():
    assert imports("llmctl.paths") == set()  # default_init, which may download, is model/spec.py's


def _loaded_after(statement):
    """The llmctl modules (and whether NumPy) a fresh interpreter has loaded after `statement`."""
    code = f"import sys; {statement}; print(' '.join(sorted(m for m in sys.modules if m.startswith(('llmctl', 'numpy')))))"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_importing_the_file_formats_does_not_load_the_model():
    loaded = _loaded_after("import llmctl.formats")
    assert "llmctl.formats" in loaded and "llmctl.model.config" in loaded
    assert not {m for m in loaded if m.startswith(("llmctl.model.gpt2", "llmctl.model.spec", "llmctl.model.ops",
                                                   "llmctl.hf", "llmctl._ext"))}


def test_the_model_config_loads_alone_and_the_model_names_on_first_use():
    assert not {m for m in _loaded_after("import llmctl.model.config") if m.startswith("numpy")}
    loaded = _loaded_after("from llmctl.model import GPT2, load")
    assert {"llmctl.model.gpt2", "llmctl.model.spec"} <= loaded


def test_gpt2s_vocabulary_numbers_are_written_once_in_constants():
    from llmctl import constants

    numbers = {constants.GPT2_VOCAB_SIZE, constants.GPT2_EOT, constants.GPT2_PADDED_VOCAB_SIZE,
               constants.LLAMA3_EOT, constants.LLAMA3_VOCAB_SIZE}
    found = [(name, node.lineno) for name in MODULES if name != "llmctl.constants"
             for node in ast.walk(ast.parse(MODULES[name].read_text()))
             if isinstance(node, ast.Constant) and type(node.value) is int and node.value in numbers]
    assert found == []
    assert imports("llmctl.constants") == set()


def test_the_transports_import_neither_the_training_nor_job_control():
    below = {m: imports(m) for m in MODULES if m.startswith("llmctl.distributed")}
    assert len(below) > 5
    assert {m: sorted(i for i in deps if i.startswith(("llmctl.train", "llmctl.jobs")))
            for m, deps in below.items()} == {m: [] for m in below}
    loaded = _loaded_after("import llmctl.distributed.hier, llmctl.distributed.ring, llmctl.distributed.shm")
    assert not {m for m in loaded if m.startswith(("llmctl.train", "llmctl.jobs"))}


def test_the_launchers_training_hints_come_from_the_training_side():
    """The hints for a training run (resume with -y 1) come from the training side, not from the
    launcher or a transport."""
    for name in ("llmctl.jobs.launcher", "llmctl.jobs.multinode", *(m for m in MODULES if m.startswith("llmctl.distributed"))):
        assert "-y 1" not in MODULES[name].read_text(), name
    assert "llmctl.train" in imports("llmctl.jobs.run")


def test_only_the_cli_starts_jobs():
    """Job control sits above the training and the evaluation: nothing below it imports it."""
    above = {"llmctl.cli"} | {m for m in MODULES if m.startswith("llmctl.jobs")}
    importers = {m for m in MODULES if m not in above
                 and any(i.startswith("llmctl.jobs") for i in imports(m))}
    assert importers == set()
