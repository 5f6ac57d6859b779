"""How the first pass of `make test` deals its tests to pytest-xdist's workers (`--dist loadfile
--no-loadscope-reorder`, hooked in tests/conftest.py).

A unit of work goes to one worker whole. Each test file is one unit, as with `--dist loadfile` (module-scoped
fixtures are built once), but the vLLM tier's files are one unit together: each builds vLLM engines of several GB,
and with three workers, while those files could run side by side, the 24 GiB CI machine once got down to 3.6 GiB
available.
The workers report their tests in queue order: the vLLM unit first (the longest, about 700 s, so that it does not
end the pass alone), then the others by number of tests, as pytest-xdist's own reordering would.

(pytest-xdist's `--dist loadgroup` would group by an `xdist_group` mark, but it renames the test ids to do so, which
pytest 9 ignores: every test then is a unit of its own.)
"""

from __future__ import annotations

VLLM_UNIT = "tests_vllm/"


def unit_of(nodeid: str) -> str:
    """The unit of work of the test `nodeid`: its file, or `VLLM_UNIT` for the vLLM tier's."""
    return VLLM_UNIT if nodeid.startswith(VLLM_UNIT) else nodeid.partition("::")[0]


def in_queue_order(items: list) -> list:
    """`items` unit by unit (each unit's tests in their order): the vLLM unit, then by number of tests."""
    units: dict[str, list] = {}
    for item in items:
        units.setdefault(unit_of(item.nodeid), []).append(item)
    ordered = sorted(units.items(), key=lambda unit: (unit[0] != VLLM_UNIT, -len(unit[1])))
    return [item for _, unit_items in ordered for item in unit_items]


def make_scheduler(config, log):
    """pytest-xdist's file scheduler with `unit_of`'s units, for `--dist loadfile`; None otherwise."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Units(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return Units(config, log)
