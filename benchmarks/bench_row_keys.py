"""What the rows' sampling keys cost a generation: folded eagerly per row count against one bucketed program.

Every `NativeEngine.generate` derives each row's key from the seed, its prompt and its sample index
(`feynrl_jax.rollout.sampling.row_keys`). Folded eagerly (`jax.vmap` of two `fold_in`s outside `jit`, as before),
each new row count compiled two programs in the middle of a generation; a run meets several counts (the warm-up's
dummy prompts, the training batch, the held-out evaluation). `row_keys` now pads the rows to a bucket and folds them
in one jitted program, compiled once for every count up to `ROW_KEY_BUCKET`.

Each side runs in a fresh process (nothing compiled is shared; JAX's persistent cache is off), the two alternating
for `--rounds`. A side times the first call for each row count of `--rows` in turn (compiling what it needs, then
running) and a later call (run only), and counts the programs compiled. Both sides' keys are checked to be equal.

    python benchmarks/bench_row_keys.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from bench_report import alternate_sides

SIDES = ("eager", "bucketed")


def measure(side: str, rows: list[int]) -> dict:
    """The first and a later call of this side's row keys for each count of `rows`, in this process."""
    os.environ.update(JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from feynrl_jax.compile_clock import compile_clock
    from feynrl_jax.rollout import sampling

    def eager(seed, request_ids, sample_ids):  # the previous `row_keys`
        base = jax.random.PRNGKey(seed)
        fold = lambda r, s: jax.random.fold_in(jax.random.fold_in(base, r), s)  # noqa: E731
        return np.asarray(jax.vmap(fold)(jnp.asarray(request_ids, jnp.uint32), jnp.asarray(sample_ids, jnp.uint32)))

    keys_of = {"eager": eager, "bucketed": sampling.row_keys}[side]
    clock = compile_clock()
    jax.random.PRNGKey(0)  # the seed's own program, the same on both sides
    programs, seconds = len(clock.names()), clock.seconds()
    first, later, digest = {}, {}, 0
    for n in rows:
        ids = np.arange(n, dtype=np.int32)
        t0 = time.perf_counter()
        keys = keys_of(7, ids // 8, ids % 8)
        first[n] = time.perf_counter() - t0
        t0 = time.perf_counter()
        keys_of(7, ids // 8, ids % 8)
        later[n] = time.perf_counter() - t0
        digest = (digest * 31 + int(np.asarray(keys, np.uint64).sum())) % (1 << 61)
    return {
        "first_seconds": first,
        "later_seconds": later,
        "first_total_seconds": sum(first.values()),
        "programs_compiled": len(clock.names()) - programs,
        "compile_seconds": clock.seconds() - seconds,
        "keys_digest": digest,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64], help="row counts, in call order")
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a child's side
    args = parser.parse_args()
    if args.side:
        print(json.dumps(measure(args.side, args.rows)))
        return
    results = alternate_sides(__file__, SIDES, args.rounds, ["--rows", *map(str, args.rows)])
    digests = {r["keys_digest"] for side in SIDES for r in results[side]}
    if len(digests) != 1:
        raise SystemExit(f"the two sides' keys differ: {digests}")
    summary = {"rows": args.rows, "rounds": args.rounds}
    for side in SIDES:
        runs = results[side]
        summary[side] = {
            "first_total_seconds_median": statistics.median(r["first_total_seconds"] for r in runs),
            "compile_seconds_median": statistics.median(r["compile_seconds"] for r in runs),
            "programs_compiled": sorted({r["programs_compiled"] for r in runs}),
            "later_seconds_median": {n: statistics.median(r["later_seconds"][str(n)] for r in runs) for n in args.rows},
        }
    summary["first_calls_ratio_eager_over_bucketed"] = (
        summary["eager"]["first_total_seconds_median"] / summary["bucketed"]["first_total_seconds_median"]
    )
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
