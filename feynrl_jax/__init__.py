"""feynrl-jax: algorithm-first post-training (SFT, DPO, RL) for large language models in JAX."""

__version__ = "0.1.0"
