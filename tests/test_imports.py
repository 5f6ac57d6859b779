"""Enforces the import rules of DESIGN.md by parsing (never importing) every module.

Rules:
    * `losses/` imports only jax, numpy, chex, the standard library and itself.
    * `sharding/` imports only jax, numpy, the standard library and itself.
    * `rollout/` never imports `losses/`.
    * Nothing in the package outside `feynrl_jax/orchestration/` imports ray (tests may, to drive it).
    * Nothing imports torch or vllm at module level except `rollout/vllm_engine.py`, tests and benchmarks.
    * `configs/` import only ml_collections, the standard library and `feynrl_jax.config`.
    * `feynrl_jax/config/` and `feynrl_jax/cli/` import no JAX-family or heavy library at module level, so a bad
      config fails before anything heavy starts.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Folder -> installed package name (pyproject's package-dir).
PACKAGE_ROOTS = {
    "feynrl_jax": "feynrl_jax",
    "losses": "feynrl_jax.losses",
    "rollout": "feynrl_jax.rollout",
    "sharding": "feynrl_jax.sharding",
}
STDLIB = frozenset(sys.stdlib_module_names) | {"__future__"}
HEAVY = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax",
    "chex",
    "ray",
    "torch",
    "vllm",
    "transformers",
    "tensorflow",
    "tensorflow_datasets",
    "grain",
    "wandb",
)


@dataclasses.dataclass(frozen=True)
class Import:
    file: pathlib.Path
    line: int
    module: str  # Absolute dotted name.
    top_level: bool  # Executed at module import time (not inside a function).

    def __str__(self):
        return f"{self.file.relative_to(ROOT)}:{self.line} imports {self.module}"


def module_name(path: pathlib.Path) -> str:
    """The installed dotted name of a file under a package root, else its path-derived name."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if parts[0] in PACKAGE_ROOTS:
        return ".".join([PACKAGE_ROOTS[parts[0]], *parts[1:]])
    return ".".join(parts)


def imports_of(path: pathlib.Path, name: str | None = None) -> list[Import]:
    """Every import statement of the file at `path`, whose dotted module name is `name` (default: derived)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node, top_level):
        for child in ast.iter_child_nodes(node):
            inner = top_level and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend(Import(path, child.lineno, alias.name, top_level) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module
                found.append(Import(path, child.lineno, target, top_level))
                if not child.module:  # `from . import x` imports submodules.
                    found.extend(Import(path, child.lineno, f"{target}.{a.name}", top_level) for a in child.names)
            visit(child, inner)

    visit(tree, True)
    return found


def python_files(*folders: str) -> list[pathlib.Path]:
    files = []
    for folder in folders:
        files += sorted((ROOT / folder).rglob("*.py")) if (ROOT / folder).is_dir() else []
    return [f for f in files if ".venv" not in f.parts]


def under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def root(module: str) -> str:
    return module.split(".")[0]


ALL_IMPORTS = [
    imp for f in python_files(*PACKAGE_ROOTS, "configs", "tests", "benchmarks", "launch") for imp in imports_of(f)
]


def in_folder(imp: Import, folder: str) -> bool:
    return imp.file.is_relative_to(ROOT / folder)


def violations(predicate) -> list[str]:
    return [str(imp) for imp in ALL_IMPORTS if predicate(imp)]


def test_the_parser_sees_the_package():
    names = {imp.module for imp in ALL_IMPORTS}
    assert "ml_collections" in names and "feynrl_jax.config.base" in names
    assert module_name(ROOT / "losses" / "grpo.py") == "feynrl_jax.losses.grpo"
    assert module_name(ROOT / "rollout" / "rewards" / "__init__.py") == "feynrl_jax.rollout.rewards"


def test_losses_import_only_jax_numpy_chex_and_themselves():
    allowed = {"jax", "numpy", "chex"} | STDLIB
    assert not violations(
        lambda i: in_folder(i, "losses") and root(i.module) not in allowed and not under(i.module, "feynrl_jax.losses")
    )


def test_sharding_imports_only_jax_numpy_and_itself():
    allowed = {"jax", "numpy"} | STDLIB
    assert not violations(
        lambda i: (
            in_folder(i, "sharding") and root(i.module) not in allowed and not under(i.module, "feynrl_jax.sharding")
        )
    )


def test_rollout_never_imports_losses():
    assert not violations(lambda i: in_folder(i, "rollout") and under(i.module, "feynrl_jax.losses", "losses"))


def test_only_orchestration_imports_ray():
    package_folders = (*PACKAGE_ROOTS, "configs")
    assert not violations(
        lambda i: (
            root(i.module) == "ray"
            and any(in_folder(i, f) for f in package_folders)
            and not in_folder(i, "feynrl_jax/orchestration")
        )
    )


def test_torch_and_vllm_only_imported_lazily():
    exempt = (ROOT / "rollout" / "vllm_engine.py",)
    assert not violations(
        lambda i: (
            root(i.module) in ("torch", "vllm")
            and i.top_level
            and i.file not in exempt
            and not in_folder(i, "tests")
            and not in_folder(i, "benchmarks")
        )
    )


def test_configs_import_only_ml_collections_and_the_config_package():
    allowed = {"ml_collections"} | STDLIB
    assert not violations(
        lambda i: in_folder(i, "configs") and root(i.module) not in allowed and not under(i.module, "feynrl_jax.config")
    )


@pytest.mark.parametrize("folder", ["feynrl_jax/config", "feynrl_jax/cli"])
def test_config_and_cli_start_light(folder):
    assert not violations(lambda i: in_folder(i, folder) and i.top_level and root(i.module) in HEAVY)
    # Nothing they import from the package at module level may be outside the light packages either.
    assert not violations(
        lambda i: (
            in_folder(i, folder)
            and i.top_level
            and under(i.module, "feynrl_jax")
            and not under(
                i.module, "feynrl_jax.config", "feynrl_jax.cli", "feynrl_jax.errors", "feynrl_jax.losses.registry"
            )
        )
    )


def test_the_algorithm_registry_is_plain_data():
    """The config layer validates `algo.name` against the registry, so it imports only the standard library (the
    losses load when first used)."""
    assert not violations(lambda i: i.file == ROOT / "losses" / "registry.py" and root(i.module) not in STDLIB)


def test_parser_resolves_relative_and_lazy_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from .batch import TrainBatch\nfrom .. import models\nimport ray\n\ndef f():\n    import torch\n")
    found = imports_of(probe, name="feynrl_jax.losses.probe")
    assert [(i.module, i.top_level) for i in found] == [
        ("feynrl_jax.losses.batch", True),
        ("feynrl_jax", True),
        ("feynrl_jax.models", True),
        ("ray", True),
        ("torch", False),
    ]
