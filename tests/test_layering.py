"""The package's layering holds: imports only point down, and no import hides in a function.

In the spirit of Ray's ``test_circular_imports``: a static check of every import
statement, and a dynamic check that importing a lower layer loads nothing above it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import ray_goodput

PACKAGE = Path(ray_goodput.__file__).parent

# Low to high. Packages in one layer are siblings: they must not import each other.
LAYERS: list[tuple[str, ...]] = [
    ("ray_goodput.errors", "ray_goodput._lazy"),
    ("ray_goodput._env",),
    ("ray_goodput._faults", "ray_goodput.testing"),
    ("ray_goodput.storage",),
    ("ray_goodput.runtime",),
    ("ray_goodput.goodput", "ray_goodput.plan"),
    # the checkpoint package by role, its save path top-down (see its __init__)
    ("ray_goodput.checkpoint.protocol",),
    ("ray_goodput.checkpoint.save",),
    ("ray_goodput.checkpoint.uploader", "ray_goodput.checkpoint.restore"),
    ("ray_goodput.checkpoint", "ray_goodput.data"),
    ("ray_goodput.replica",),
    ("ray_goodput.driver",),
    ("ray_goodput.cli", "ray_goodput.demo"),
    ("ray_goodput",),
]


def _unit(module: str) -> tuple[int, str]:
    """(layer, package) of a module: the longest matching prefix in LAYERS."""
    best = None
    for level, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best[1])):
                best = (level, name)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _lazy_module_target(node: ast.AST) -> str | None:
    if (
        isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "LazyModule"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    ):
        return node.args[0].value
    return None


def _imports(name: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported ray_goodput module, line, inside a function) of every import in ``path``."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # never executed
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_function) for a in child.names)
            elif _lazy_module_target(child) is not None:  # LazyModule("ray_goodput..."): an import too
                found.append((_lazy_module_target(child), child.lineno, in_function))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - child.level + 1]
                        + ([child.module] if child.module else [])
                    )
                for alias in child.names:
                    target = f"{base}.{alias.name}"
                    found.append((target if target in MODULES else base, child.lineno, in_function))
            visit(child, nested)

    visit(tree, False)
    return [(m, line, fn) for m, line, fn in found if m == "ray_goodput" or m.startswith("ray_goodput.")]


def test_imports_only_point_down_and_siblings_stay_apart():
    wrong = []
    for name, path in sorted(MODULES.items()):
        level, package = _unit(name)
        for target, line, _ in _imports(name, path):
            t_level, t_package = _unit(target)
            if t_level > level or (t_level == level and t_package != package):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} {name} -> {target}")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_no_library_import_hides_in_a_function():
    hidden = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
        for name, path in sorted(MODULES.items())
        for target, line, in_function in _imports(name, path)
        if in_function
    ]
    assert not hidden, "function-local imports of ray_goodput modules:\n" + "\n".join(hidden)


def test_a_lower_layer_imports_nothing_above_it():
    """Import each layer's packages, bottom up, in a fresh interpreter; after each import no
    module of a higher layer may be loaded (a package's own ``__init__``, which Python runs
    to reach a subpackage, excepted: it must load nothing itself)."""
    script = (
        "import importlib, sys, json\n"
        f"layers = {[[n for n in names if n in MODULES] for names in LAYERS[:-1]]!r}\n"
        "def level(m):\n"
        "    best = max(((len(n), i) for i, names in enumerate(layers) for n in names\n"
        "                if m == n or m.startswith(n + '.')), default=None)\n"
        "    return None if best is None else best[1]\n"
        "out = []\n"
        "for i, names in enumerate(layers):\n"
        "    for name in names:\n"
        "        importlib.import_module(name)\n"
        "        ancestors = {name.rsplit('.', k)[0] for k in range(1, name.count('.') + 1)}\n"
        "        out += [f'{name} loaded {m}' for m in list(sys.modules)\n"
        "                if m not in ancestors and (level(m) or -1) > i]\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def _in_a_fresh_interpreter(script: str) -> None:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_public_names_and_subpackages_load_on_first_use():
    _in_a_fresh_interpreter(
        "import sys, ray_goodput\n"
        "assert 'torch' not in sys.modules\n"
        # what a node's health-check task imports: no torch, Ray Train or MLflow
        "import ray_goodput.driver._health\n"
        "assert not {'torch', 'ray.train', 'mlflow'} & set(sys.modules), sorted(sys.modules)\n"
        "assert ray_goodput.data.DataLoader.__name__ == 'DataLoader'\n"
        "assert ray_goodput.TorchTrainer.__name__ == 'TorchTrainer'\n"
        "assert set(ray_goodput.__all__) <= set(dir(ray_goodput))\n"
    )


def test_a_process_that_never_uses_ray_does_not_import_it(tmp_path):
    """A rank that saves through the thread backend and reads without a node cache (a
    ``run_world`` rank, a plain torchrun job) does not pay ~0.65 s for ``import ray``."""
    _in_a_fresh_interpreter(
        "import sys, torch\n"
        "from ray_goodput import Checkpointer\n"
        "from ray_goodput.data import DataLoader, FileDataset\n"
        "from ray_goodput.runtime import WorkerContext\n"
        "assert WorkerContext.detect().node_id is None\n"
        f"with Checkpointer({str(tmp_path / 'ckpt')!r}, staging_dir={str(tmp_path / 's')!r}) as ckpt:\n"
        "    state = {'model': torch.nn.Linear(2, 2)}\n"
        "    ckpt.restore(state)\n"
        "    ckpt.save(1, state)\n"
        "assert 'ray' not in sys.modules, [m for m in sys.modules if m.startswith('ray.')]\n"
    )


def test_a_lazy_module_survives_pickle_and_copy_without_importing():
    """Pickle, copy and introspection probe private names; they must not import the module
    (or recurse: ``_module`` is looked up before ``__init__`` ran on an unpickled copy)."""
    _in_a_fresh_interpreter(
        "import copy, pickle, sys\n"
        "from ray_goodput._lazy import LazyModule\n"
        "m = LazyModule('ray')\n"
        "copy.copy(pickle.loads(pickle.dumps(m)))\n"
        "assert not hasattr(m, '__wrapped__') and 'ray' not in sys.modules\n"
        "assert LazyModule('json').dumps([1]) == '[1]' and 'json' in sys.modules\n"
    )


def test_the_demos_training_workers_do_not_import_mlflow():
    """Each Ray Train worker imports the module of the training function it runs. The demo
    (the README's main job) imported MLflow at module level, for the driver's summary:
    2.4 s of imports in every worker of every attempt, before its first step."""
    _in_a_fresh_interpreter(
        "import sys\n"
        "import ray_goodput.demo\n"
        "assert 'mlflow' not in sys.modules, sorted(m for m in sys.modules if m.startswith('mlflow'))[:5]\n"
    )


def test_ray_trains_controller_does_not_import_dcp_for_ray_goodputs_callbacks():
    """Ray Train's controller unpickles the run's callbacks when it starts, before it starts
    the workers. Recovery's resume choice reads commits, and the commit module imported
    torch.distributed.checkpoint (DTensor, sympy: 1.1 s on the development machine, more
    while workers start beside it) on every run's start, for code only a commit runs."""
    _in_a_fresh_interpreter(
        "import sys\n"
        "import ray_goodput.driver._trainer\n"  # every callback ray_goodput.TorchTrainer adds
        "from ray_goodput.driver import GoodputCallback, Recovery\n"
        "assert 'torch.distributed.checkpoint' not in sys.modules, 'DCP imported by the controller side'\n"
    )


def test_the_node_cache_actor_does_not_import_torch():
    """A node cache actor imports the module of its class when it starts. Through the
    ``data`` package (its DataLoader) and the worker context it imported torch: ~1.1 s of
    CPU and ~180 MB (peak RSS of the import: 283 MB with torch, 104 MB without) in an actor
    that only moves files."""
    _in_a_fresh_interpreter(
        "import sys\n"
        "import ray_goodput.data._cache_actor\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "from ray_goodput.data import CacheConfig, DataLoader\n"  # the package's names still load
        "assert DataLoader.__module__ == 'ray_goodput.data._loader' and 'torch' in sys.modules\n"
    )


def test_the_node_uploader_imports_torch_only_after_it_lowered_its_priority():
    """A node uploader imports the module of its class when it starts, beside the training
    workers that are importing torch themselves. It imported torch and DCP there (~1.6 s of
    CPU), at the workers' priority, before its ``__init__`` could lower its own: the workers
    started later by the time that took on a small node."""
    _in_a_fresh_interpreter(
        "import sys\n"
        "import ray_goodput.checkpoint.uploader._actor as actor\n"
        "assert 'torch' not in sys.modules, 'torch imported with the actor module'\n"
        "actor.job_modules()\n"  # what the actor's __init__ does once it lowered its priority
        "assert 'torch.distributed.checkpoint' in sys.modules\n"
        "import torch\n"
        "assert torch.get_num_threads() == 1\n"
    )


def test_every_test_file_stays_under_800_lines():
    """Tests are grouped by component, a file per topic (issue 30): two files had grown past
    900 lines of several topics each before this check."""
    tests = Path(__file__).resolve().parent
    long = {p.name: n for p in tests.glob("*.py") if (n := len(p.read_text().splitlines())) > 800}
    assert long == {}, f"split these test files by topic: {long}"


def test_no_library_function_is_over_60_lines():
    """STYLE: no library function over 60 lines, its docstring included. Ten had grown past
    it (a save's job, the commit, the restore's load and choice among them)."""
    package = Path(__file__).resolve().parents[1] / "ray_goodput"
    long = {
        f"{p.relative_to(package)}:{n.lineno} {n.name}": n.end_lineno - n.lineno + 1
        for p in package.rglob("*.py")
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60
    }
    assert long == {}, f"split these functions: {long}"
