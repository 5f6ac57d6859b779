"""JAX's persistent compilation cache: the CLI points it at the project's cache folder unless the user chose."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from feynrl_jax import cache_dirs


def test_default_folder_is_under_the_cache_root_and_a_users_choice_is_kept(tmp_path):
    environ = {"FEYNRL_JAX_CACHE": str(tmp_path)}
    assert cache_dirs.set_compile_cache_dir(environ) == str(tmp_path / "jax_compile_cache")
    assert environ == {
        "FEYNRL_JAX_CACHE": str(tmp_path),
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_compile_cache"),
        "JAX_COMPILATION_CACHE_MAX_SIZE": str(cache_dirs.DEFAULT_MAX_BYTES),  # the default folder is bounded
    }
    mine = {"FEYNRL_JAX_CACHE": str(tmp_path), "JAX_COMPILATION_CACHE_DIR": "/elsewhere"}
    assert cache_dirs.set_compile_cache_dir(mine) == "/elsewhere"
    assert "JAX_COMPILATION_CACHE_MAX_SIZE" not in mine  # the user's folder, the user's bound
    bounded = {"FEYNRL_JAX_CACHE": str(tmp_path), "JAX_COMPILATION_CACHE_MAX_SIZE": "-1"}
    cache_dirs.set_compile_cache_dir(bounded)
    assert bounded["JAX_COMPILATION_CACHE_MAX_SIZE"] == "-1"
    # An empty value turns the cache off: it stays empty, and JAX's switch goes off with it.
    off = {"JAX_COMPILATION_CACHE_DIR": ""}
    assert cache_dirs.set_compile_cache_dir(off) is None
    assert off == {"JAX_COMPILATION_CACHE_DIR": "", "JAX_ENABLE_COMPILATION_CACHE": "false"}
    xdg = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert cache_dirs.set_compile_cache_dir(xdg) == str(tmp_path / "xdg" / "feynrl_jax" / "jax_compile_cache")


# The CLI's entry point on a command that fails at once (no such run folder), then a jitted function: the program
# lands in the folder the entry point chose, since JAX reads the variable when it is imported.
ENTRY_THEN_COMPILE = textwrap.dedent(
    """
    import os, sys
    sys.argv = ["feynrl-jax", "plot", "/nonexistent/run"]
    from feynrl_jax.cli import main
    try:
        main.run()
    except SystemExit:
        pass
    import jax
    print(jax.jit(lambda x: x * 2 + 1)(3))
    print(os.environ["JAX_COMPILATION_CACHE_DIR"])
    """
)


def test_the_cli_entry_point_sends_compiled_programs_to_the_cache_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(FEYNRL_JAX_CACHE=str(tmp_path), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", ENTRY_THEN_COMPILE], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    folder = tmp_path / "jax_compile_cache"
    assert done.stdout.split()[-2:] == ["7", str(folder)]
    assert folder.is_dir() and any(folder.iterdir()), "no compiled program was written to the cache folder"
