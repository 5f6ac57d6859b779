"""pyproject.toml lists every package folder with the right `package-dir` mapping, and the install uses it; the
environment holds the versions of constraints.txt (`make setup` installs with it)."""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
EXPECTED_ROOTS = {
    "feynrl_jax": "feynrl_jax",
    "feynrl_jax.losses": "losses",
    "feynrl_jax.rollout": "rollout",
    "feynrl_jax.sharding": "sharding",
}


def package_folders() -> dict[str, pathlib.Path]:
    """Installed package name -> folder, for every folder holding an `__init__.py` under a package root."""
    found = {}
    for name, folder in EXPECTED_ROOTS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder)
            found[".".join([name, *rel.parts])] = init.parent
    return found


def test_package_dir_maps_the_three_axes_under_one_namespace():
    assert SETUPTOOLS["package-dir"] == EXPECTED_ROOTS


def test_every_package_folder_is_listed_and_every_listed_package_exists():
    folders = package_folders()
    listed = set(SETUPTOOLS["packages"])
    missing = sorted(set(folders) - listed)
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"
    stale = sorted(listed - set(folders))
    assert not stale, f"listed in pyproject.toml but no folder with an __init__.py: {stale}"


def test_installed_packages_resolve_to_the_repository_folders():
    for name, folder in package_folders().items():
        spec = importlib.util.find_spec(name)
        assert spec is not None, f"{name} is not importable; reinstall with `pip install -e .`"
        assert pathlib.Path(spec.origin).resolve() == (folder / "__init__.py").resolve(), name


def test_console_script_points_at_a_function():
    target = PYPROJECT["project"]["scripts"]["feynrl-jax"]
    module, _, function = target.partition(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_no_test_or_config_folder_is_a_package():
    # configs/ are loaded by path and tests/ by pytest; an __init__.py there would shadow installed names.
    for folder in ("configs", "tests", "benchmarks", "launch"):
        assert not (ROOT / folder / "__init__.py").exists(), folder


def test_the_environment_holds_the_versions_of_constraints_txt():
    """`make setup` installs with `-c constraints.txt` (why each version is held back is in the file); an
    environment installed without it still works, but slower, and this says how to match the project's."""
    from importlib.metadata import version

    from packaging.requirements import Requirement

    held = []
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            requirement = Requirement(entry)
            if requirement.marker is None or requirement.marker.evaluate():
                held.append(requirement)
    assert held, "constraints.txt holds no version"
    for requirement in held:
        installed = version(requirement.name)
        assert requirement.specifier.contains(installed, prereleases=True), (
            f"{requirement.name} {installed} is installed; constraints.txt wants {requirement.specifier} "
            "(.venv/bin/pip install -c constraints.txt -e '.[dev,vllm,onednn]')"
        )
