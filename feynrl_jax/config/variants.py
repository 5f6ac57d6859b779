"""The argument string of `get_config(arg)`: comma-separated variant names, e.g. "runlocal,tiny".

`--config=configs/grpo_demo.py:runlocal,chain_sum` passes "runlocal,chain_sum" to `get_config`; each experiment
file lists the variants it knows and applies them in one place.
"""

from __future__ import annotations

from collections.abc import Iterable

from ml_collections import ConfigDict

from feynrl_jax.config.errors import ConfigError, Problem, suggestion


def parse_variants(arg: str | None, known: Iterable[str]) -> frozenset[str]:
    """Splits `arg` on commas and checks every name against `known`.

    Args:
        arg: the text after the colon of `--config=file.py:arg`, or None.
        known: the variant names the experiment file supports.

    Returns:
        The set of requested variant names (empty for None or "").

    Raises:
        ConfigError: naming the unknown variant and the closest known one.
    """
    known = tuple(known)
    names = frozenset(part.strip() for part in (arg or "").split(",") if part.strip())
    unknown = sorted(names - set(known))
    if unknown:
        raise ConfigError(
            Problem(
                f"variant:{name}",
                f"unknown config variant {name!r}{suggestion(name, known)}; known: {', '.join(known)}.",
            )
            for name in unknown
        )
    return names


def use_tiny_model(config: ConfigDict) -> None:
    """Swaps the model for a tiny random-init one that keeps SmolLM2's tokenizer (tests, CPU smoke runs)."""
    config.model.random_init = True
    config.model.path = None
    config.model.gguf = None
    config.model.tokenizer = "smollm2"
    arch = config.model.arch
    arch.hidden_size, arch.intermediate_size, arch.num_layers = 64, 128, 2
    arch.num_heads, arch.num_kv_heads, arch.head_dim = 4, 2, 16
    # Recomputing layers saves memory that a 2-layer model does not use, and costs compile and step time.
    config.model.remat = "none"
