"""Data: sources, the common example format, tokenisation with loss masks, packing, mixtures and batches.

Modules:
    examples: the common example format, its validation and the data errors.
    file_sources: local JSONL and Parquet files.
    tfds_source: a tensorflow-datasets builder writing array_record files, and a ``tfds.data_source`` reader.
    reasoning_gym_source: procedural reasoning-gym tasks with a held-out split by seed; DPO pairs from them.
    champ_source: CHAMP competition-math problems for evaluation.
    tokenization: chat-template rendering and prompt/response tokenisation with loss masks.
    packing: fixed-shape ``[B, T]`` batches and sequence packing with ``segment_ids``.
    mixture: a seeded weighted mixture (index-based sampler) whose iterator state is a small JSON dict.
    batches: SFT, DPO and RL prompt batch builders.
    from_config: the config edge, ``build_mixture_from_config``.
    toy_tokenizer: a tiny local byte-level BPE tokenizer for tests and smoke runs.
"""

from feynrl_jax.data.batches import DPOBatches, PromptBatch, PromptBatches, SFTBatches
from feynrl_jax.data.examples import BadRowError, DataError, validate_example
from feynrl_jax.data.file_sources import ExampleSource, from_examples, read_jsonl, read_parquet
from feynrl_jax.data.from_config import build_mixture_from_config, build_sources_from_config
from feynrl_jax.data.mixture import ExampleStream, MixtureSource, Skip
from feynrl_jax.data.packing import TokenBatch, pack_sequences
from feynrl_jax.data.tokenization import TokenizedSequence, render_prompt, tokenize_prompt, tokenize_prompt_response

__all__ = [
    "BadRowError",
    "DPOBatches",
    "DataError",
    "ExampleSource",
    "ExampleStream",
    "MixtureSource",
    "PromptBatch",
    "PromptBatches",
    "SFTBatches",
    "Skip",
    "TokenBatch",
    "TokenizedSequence",
    "build_mixture_from_config",
    "build_sources_from_config",
    "from_examples",
    "pack_sequences",
    "read_jsonl",
    "read_parquet",
    "render_prompt",
    "tokenize_prompt",
    "tokenize_prompt_response",
    "validate_example",
]
