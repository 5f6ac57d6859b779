"""A colocated run's start: the update's compile-ahead after the engine's warm-up, against both at once.

With `rollout.colocate` the rollout engine lives in the trainer's process, and so do both start-up compiles: the
engine's warm-up (`EngineHost.warm_up`: the decode dispatch, prefill and the small programs around them) and the
update's compile-ahead (`RLTrainer._compile_update`: the train step). Compiles in one process do not run side by
side: one started beside a long one waits for much of it. The trainer therefore holds its compile-ahead until the
warm-up has ended (`TrainerActor._after_warm_up`, given to `RLTrainer` as its `compile_after`), since the first
generation needs the warm-up's programs before the first update needs the train step. This benchmark runs the
demo's start both ways, in the demo's own pieces, without Ray:
  - `after` (what a run does): the trainer's `compile_after` waits for the warm-up's end
    (`EngineHost.wait_for_warm_up`);
  - `together` (before the change): no wait; the two compile at once.

Each side, in a fresh process: the demo config (`configs/grpo_demo.py`, colocated) builds the trainer and its
engine host as `TrainerActor` does; the warm-up starts in a thread for the first batch's prompt lengths, and the
trainer's `start` runs meanwhile (as the driver calls them); then the first batch is generated on the trainer's
params and trained on (zero rewards). JAX's persistent compilation cache is off, so everything compiles. Figures,
seconds from the warm-up's start:
  - `start_seconds`: the trainer's `start` returned (state built; not a compile);
  - `warm_up_seconds`: the warm-up ended (what the first generation waits for);
  - `past_start_seconds`: the warm-up's end after `start` returned, what `learning_vs_trl.py` charges to step 1
    (`perf/rollout_warmup_past_start_seconds`);
  - `generated_seconds`: the first batch generated (no compile left in it on either side);
  - `first_update_seconds`: that batch's update done, its compile-ahead waited for: the first step's end.

    python benchmarks/bench_compile_order.py --rounds 3 --json docs/bench_compile_order.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

from bench_report import alternate_sides, report_sides

from feynrl_jax.host_memory import reexec_with_allocator_tunables

reexec_with_allocator_tunables()  # the allocator the CLI runs with on a machine of 2 cores (and `make` everywhere)

SIDES = ("together", "after")


def measure(side: str) -> dict[str, float]:
    """One start of the colocated demo, in this process."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    os.environ["JAX_COMPILATION_CACHE_DIR"] = ""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs"))
    import grpo_demo
    import numpy as np

    from feynrl_jax.models import as_param_dtype
    from feynrl_jax.orchestration.actors import ParamsSnapshot
    from feynrl_jax.orchestration.engine_host import EngineHost
    from feynrl_jax.orchestration.rl_loop import _Run, rollout_sampling
    from feynrl_jax.train.rl_trainer import RLTrainer

    with tempfile.TemporaryDirectory(prefix="bench_compile_order_") as work:
        config = grpo_demo.get_config()
        config.run_dir = os.path.join(work, "run")
        config.rollout.colocate = True
        config.checkpoint.every_steps = 0
        driver = _Run(config)  # model source, tokenizer, data, the first batch's prompt lengths, the engine's spec
        hosts = []  # the engine's host, built after the trainer (as in `TrainerActor`)
        after = (lambda: hosts[0].wait_for_warm_up(600.0) or True) if side == "after" else None
        trainer = RLTrainer(config, driver.model_config, compile_after=after)
        host = EngineHost(
            trainer.model_config,
            trainer.source.tokenizer_dir,
            driver.engine_spec,
            index=0,
            local_params=lambda version: as_param_dtype(trainer.state.params, trainer.model_config),
        )
        hosts.append(host)
        sampling = rollout_sampling(config, driver.tokenizer, config.seed)
        marks: dict[str, float] = {}
        t0 = time.perf_counter()

        def warm_up() -> None:
            if host.warm_up(driver.warmup_lengths, sampling).get("complete") == 1.0:
                marks["warm_up_seconds"] = time.perf_counter() - t0

        warming = threading.Thread(target=warm_up)
        warming.start()
        trainer.start()
        marks["start_seconds"] = time.perf_counter() - t0
        warming.join()
        if "warm_up_seconds" not in marks:
            raise SystemExit("the warm-up failed or was cut short (its log says why)")
        marks["past_start_seconds"] = max(0.0, marks["warm_up_seconds"] - marks["start_seconds"])
        batch = next(driver.prompts)
        compiled = host.clock.seconds()
        rollouts, _ = host.generate(batch.prompt_ids, sampling, ParamsSnapshot(version=0, refs={}, checksum=0))
        marks["generated_seconds"] = time.perf_counter() - t0
        marks["generation_compile_seconds"] = host.clock.seconds() - compiled
        rewards = np.zeros(rollouts.prompt_ids.shape[0], np.float32)
        trainer.train(rollouts, rewards, step=1, shuffle_seed=0)
        marks["first_update_seconds"] = time.perf_counter() - t0
        trainer.close()
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="", help="write the medians, ratios and runs here")
    args = parser.parse_args()
    if args.side:
        print(json.dumps(measure(args.side)), flush=True)
        return
    from bench_cpu_matmul import cpu_model

    from feynrl_jax.kernels import onednn

    runs = alternate_sides(__file__, SIDES, args.rounds)
    isa = [name for name in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if name in onednn._cpu_flags()]
    settings = {"rounds": args.rounds, "cpu": cpu_model(), "cpus": os.cpu_count(), "isa": isa}
    settings["date"] = time.strftime("%Y-%m-%d")
    report_sides(runs, "after", "together", settings=settings, json_path=args.json)


if __name__ == "__main__":
    main()
