# Entry points for builds, tests and certification. See README.md.
# A recipe line that pipes (`| tee`) fails when any stage fails.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
CARGO ?= cargo
PROFILE ?= core,cloud
SEED ?=
OUT ?= reports
# Where cargo puts its output: $CARGO_TARGET_DIR when set, as cargo does.
TARGET_DIR := $(or $(CARGO_TARGET_DIR),target)
DEBUG_DIR := $(TARGET_DIR)/debug
RELEASE_DIR := $(TARGET_DIR)/release
BIN := $(DEBUG_DIR)/bigfleet-proxmox
BFC := $(DEBUG_DIR)/bfconformance
SEED_FLAG := $(if $(SEED),--seed $(SEED),)

.PHONY: build build-proxmox run-fake test test-proxmox lint fmt certify-proxmox failover \
        report-proxmox report-ci report-durable-postgres certify-pve-sim scale-100k mutation-check bench bench-scaling bench-half-sent bench-memory bench-postgres bench-replicas bench-configure bench-api-cost bench-real crash-1000 crash-real fuzz \
        image-rootfs chart-render

build:
	$(CARGO) build --workspace

# Release build of the provider at bin/proxmox.
build-proxmox:
	$(CARGO) build --release -p bigfleet-proxmox
	mkdir -p bin
	cp $(RELEASE_DIR)/bigfleet-proxmox bin/proxmox

# The provider on the in-memory fake backend (no Proxmox cluster needed).
run-fake:
	$(CARGO) run --release -p bigfleet-proxmox -- --use-fake-backend --addr 127.0.0.1:9000 --metrics-addr 127.0.0.1:9090

# Everything CI runs: lint, the image's root filesystem (booted by
# deploy-check's image_rootfs test), every crate's tests, the mutation check
# and the certification lanes (core, cloud, fault, durable, 10k scale; the
# durable lane again with the state in PostgreSQL), and the scaling guard.
test: lint image-rootfs test-proxmox mutation-check certify-proxmox report-ci report-durable-postgres certify-pve-sim bench-scaling
	@$(SKIP_SUMMARY)

# Tests that skip for want of a tool still report `ok` (libtest has no
# skipped outcome); provider-testkit's skip::report appends each skip to
# this file, and the summary prints them (CONTRIBUTING.md, Skipped tests).
SKIPPED_LOG := $(abspath $(TARGET_DIR))/skipped-tests.log
SKIP_SUMMARY = if [ -s $(SKIPPED_LOG) ]; then \
	  echo "$$(wc -l < $(SKIPPED_LOG)) test check(s) SKIPPED (their tests report ok; install what each names, or run under CI=true to make them fail):"; \
	  sort $(SKIPPED_LOG) | sed 's/^/  /'; \
	else echo "no test skipped"; fi

# The PostgreSQL store's tests need a server: scripts/pg-throwaway.sh starts
# a throwaway one for the run (unless BIGFLEET_TEST_POSTGRES_URL names one);
# without PostgreSQL's server binaries they skip, saying so (CI fails them).
test-proxmox:
	$(CARGO) build -p bigfleet-proxmox -p conformance -p pve-sim
	rm -f $(SKIPPED_LOG)
	BIGFLEET_SKIPPED_LOG=$(SKIPPED_LOG) BIGFLEET_IMAGE_ROOTFS=$(abspath $(IMAGE_ROOTFS)) scripts/pg-throwaway.sh run -- $(CARGO) test --workspace; \
	  status=$$?; $(SKIP_SUMMARY); exit $$status

# The container image's root filesystem, without a Docker engine: the static
# (musl) release binary, CA bundle, passwd/group and /var/lib/bigfleet, built
# and staged by scripts/build-static.sh, the script deploy/Dockerfile's builder
# stage runs. Needs `rustup target add x86_64-unknown-linux-musl` and Debian's
# musl-tools; the release build takes minutes on 2 cores.
IMAGE_ROOTFS ?= $(TARGET_DIR)/image-rootfs
image-rootfs:
	scripts/build-static.sh rootfs $(IMAGE_ROOTFS)

# The chart's manifests as `helm template` writes them, one file for the
# chart's defaults, one for three replicas on PostgreSQL and one per values
# example in docs/, into OUT (default
# reports/chart); deploy-check's kubernetes_validate test validates the same set.
CHART_OUT = $(if $(filter command line environment,$(origin OUT)),$(OUT),$(OUT)/chart)
chart-render:
	$(CARGO) run -q -p deploy-check --example render-chart -- --out $(CHART_OUT)

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p providerkit -p conformance --features providerkit/mutants,conformance/mutants --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --no-deps --workspace

fmt:
	$(CARGO) fmt --all

$(BIN) $(BFC):
	$(CARGO) build -p bigfleet-proxmox -p conformance

# Baseline + extension suite against the fake backend; stops at the first failure.
certify-proxmox:
	$(CARGO) build -p bigfleet-proxmox -p conformance
	$(BFC) --provider proxmox --provider-bin $(BIN) --certify $(SEED_FLAG)

# The full runner: JUnit + JSON report under $(OUT), ends in VERDICT.
report-proxmox:
	$(CARGO) build -p bigfleet-proxmox -p conformance
	$(BFC) --provider proxmox --provider-bin $(BIN) --profile $(PROFILE) --out $(OUT) $(SEED_FLAG)

# What CI certifies: every lane, scale at 10k machines.
report-ci:
	$(MAKE) report-proxmox PROFILE=core,cloud,fault,durable,scale

# The durable lane with the provider's state in PostgreSQL: a database of
# its own in a throwaway cluster (scripts/pg-throwaway.sh; needs PostgreSQL's
# server binaries), JUnit + JSON under $(OUT)/durable-postgres.
report-durable-postgres:
	$(CARGO) build -p bigfleet-proxmox -p conformance
	env -u BIGFLEET_TEST_POSTGRES_URL scripts/pg-throwaway.sh run -- bash -c \
	  'test -n "$$BIGFLEET_TEST_POSTGRES_URL" || { echo "report-durable-postgres needs PostgreSQL (apt-get install postgresql)" >&2; exit 1; }; \
	   $(BFC) --provider proxmox --provider-bin $(BIN) --profile durable --durable-state "$$BIGFLEET_TEST_POSTGRES_URL" \
	     --out $(OUT)/durable-postgres $(SEED_FLAG)'

# The real Proxmox backend against pve-sim: core, cloud and durable lanes,
# then docs/certification.md's certify-a-real-endpoint recipe as written.
certify-pve-sim:
	$(CARGO) build -p bigfleet-proxmox -p conformance -p pve-sim
	BIN=$(DEBUG_DIR) OUT=$(OUT)/pve-sim $(if $(SEED),SEED=$(SEED),) scripts/certify-pve-sim.sh

# The scale lane at 100k machines with a two-minute soak.
scale-100k:
	$(CARGO) build --release -p bigfleet-proxmox -p conformance
	$(RELEASE_DIR)/bfconformance --provider proxmox --provider-bin $(RELEASE_DIR)/bigfleet-proxmox \
	  --profile scale --scale-count 100000 --soak 120s --out $(OUT)/scale-100k $(SEED_FLAG)

# The standard benchmark set, appended to bench/latest.txt (see BENCHMARKS.md):
# loadgen end to end over gRPC (sharing the CPUs, then pinned one CPU each),
# the engine alone in process, the durable store against a rewrite-all
# baseline, and the Create cost by template placement (real substrate on
# pve-sim: shared template, warm replica, first staging, 16-way burst).
bench:
	@mkdir -p bench
	$(MAKE) bench-scaling SCALING_OUT=bench/latest.txt
	$(MAKE) bench-half-sent
	$(RELEASE_DIR)/loadgen --provider-bin $(RELEASE_DIR)/bigfleet-proxmox --out bench/latest.txt
	$(RELEASE_DIR)/loadgen --provider-bin $(RELEASE_DIR)/bigfleet-proxmox --pin --out bench/latest.txt
	$(CARGO) bench -p providerkit --bench engine_bench | tee -a bench/latest.txt
	$(CARGO) bench -p sqlite-store --bench store_bench -- 2 | tee -a bench/latest.txt
	$(MAKE) bench-replicas
	$(MAKE) bench-configure
	$(MAKE) bench-postgres
	$(MAKE) bench-api-cost
	$(MAKE) bench-real

# The scaling guard (issue #43), in `make bench` and in `make test` (CI):
# the Create rate in memory and in SQLite (the median of nine rounds), and
# Get p99 (the median of three 3 s windows), with 1k machines and
# with 100k (a quarter of each fleet holding VMs), measured in one run and
# compared as ratios; fails when the 100k figure is under two thirds of the
# 1k one (Get p99 over 1.5x). About 40 s after the release build. Appends
# to $(SCALING_OUT): $(OUT)/scaling.txt unless `make bench` names its own.
SCALING_OUT ?= $(OUT)/scaling.txt
bench-scaling:
	$(CARGO) build --release -p bigfleet-proxmox -p loadgen
	$(RELEASE_DIR)/loadgen --provider-bin $(RELEASE_DIR)/bigfleet-proxmox --sizes 1000,100000 \
	  --only scaling --out $(SCALING_OUT)

# Callers that declare large requests and never finish sending them (issue
# #45): 4 connections x 64 half-sent Configures under the transport cap,
# then 4 x 64 half-sent 4 MB Creates; fails when the provider's RSS grows
# past 100 MiB or Get p99 passes 4x its value at rest (BENCHMARKS.md).
bench-half-sent:
	@mkdir -p bench
	$(CARGO) build --release -p bigfleet-proxmox -p loadgen
	$(RELEASE_DIR)/loadgen --provider-bin $(RELEASE_DIR)/bigfleet-proxmox --only half-sent --quick \
	  | tee -a bench/latest.txt

# Issue #24's figures, appended to bench/latest.txt: durable Create acks at
# 16 callers with the state in SQLite and in PostgreSQL at 10k and 100k
# machines, takeover between two replicas on one PostgreSQL state at 100k
# (kill -9 of the leader to the standby's /readyz 200, 3 rounds) and the
# PostgreSQL-backed provider's peak RSS; ends in `pg_acks_goal=` and
# `takeover_goal_ms=` lines. A throwaway PostgreSQL on loopback
# (scripts/pg-throwaway.sh; needs its server binaries), a database per run.
bench-postgres:
	@mkdir -p bench
	$(CARGO) build --release -p bigfleet-proxmox -p loadgen
	env -u BIGFLEET_TEST_POSTGRES_URL scripts/pg-throwaway.sh run -- bash -c \
	  'test -n "$$BIGFLEET_TEST_POSTGRES_URL" || { echo "bench-postgres needs PostgreSQL (apt-get install postgresql)" >&2; exit 1; }; \
	   $(RELEASE_DIR)/loadgen --provider-bin $(RELEASE_DIR)/bigfleet-proxmox --sizes 10000,100000 \
	     --only postgres --state-url "$$BIGFLEET_TEST_POSTGRES_URL" --out bench/latest.txt'

# Configure with 64 KiB and 1 MiB blobs on pve-sim, one at a time and 4 in
# parallel: the slowest Configure, the provider's CPU seconds, and Get p99
# while they run against Get p99 at rest (BENCHMARKS.md).
bench-configure:
	@mkdir -p bench
	$(CARGO) test --release -p bigfleet-proxmox --test integration -- --ignored --nocapture configure_load::bench_configure \
	  | tee -a bench/latest.txt

# PVE API requests per whole lifecycle in a 16-way burst on two nodes
# (issue #41's set-up: shared template, 2 s clones, 3 s agent boot, 1 s poll),
# by endpoint (BENCHMARKS.md).
bench-api-cost:
	@mkdir -p bench
	$(CARGO) test -p proxmox-backend --test integration task_cost::burst_cost -- --ignored --nocapture \
	  | tee -a bench/latest.txt

# Bursts of 16, 40 and 64 whole lifecycles over 2, 3 and 4 nodes on
# pve-sim's honest clone model (a shared 2 GiB template copied at 2 GiB/s,
# shared among the copies): time to IDLE p50/p95, makespan beside what the
# bandwidth allows, requests per lifecycle, peak requests per second
# cluster-wide and per node (issue #41, BENCHMARKS.md); then the same on
# local storage (a template per node on its local-lvm at 1 GiB/s). One
# burst at a time (--test-threads 1). About 5 minutes.
bench-real:
	@mkdir -p bench
	$(CARGO) test -p proxmox-backend --test integration bench_real -- --ignored --nocapture --test-threads 1 \
	  | tee -a bench/latest.txt

# Create latency and PVE API calls per Create by template placement, and
# the 16-way burst from one local template (BENCHMARKS.md).
bench-replicas:
	@mkdir -p bench
	$(CARGO) test -p proxmox-backend --test bench_replicas -- --ignored --nocapture \
	  | tee -a bench/latest.txt

# The memory goals alone (issue #15; also in `make bench`): peak RSS at 100k
# machines under boot + List + Get + Create, and the growth under 4
# connections x 50 full Lists never read on a 20k fleet; each ends in a
# `memory_goal=... met=true|false` line.
bench-memory:
	$(CARGO) build --release -p bigfleet-proxmox -p loadgen
	$(RELEASE_DIR)/loadgen --provider-bin $(RELEASE_DIR)/bigfleet-proxmox --sizes 100000 \
	  --only list,get,create,unread-list --out bench/memory.txt

# The parser fuzz targets (proptest properties: never panic, round-trip),
# long: CI runs the same properties with 64 cases each in `cargo test`.
FUZZ_CASES ?= 100000
fuzz:
	PROPTEST_CASES=$(FUZZ_CASES) $(CARGO) test --release -p pve --test fuzz_parsers
	PROPTEST_CASES=$(FUZZ_CASES) $(CARGO) test --release -p proxmox-backend --test fuzz_catalog
	PROPTEST_CASES=$(FUZZ_CASES) $(CARGO) test --release -p sqlite-store --test fuzz_decode

# The kill -9 crash test at 1,000 random kill points (CI runs 50).
crash-1000:
	BIGFLEET_CRASH_ITERATIONS=1000 $(CARGO) test -p bigfleet-proxmox --test crash -- --nocapture

# The kill -9 campaign on the REAL backend against pve-sim, 300 kills with a
# reclaim of every FAILED machine at the end (CI runs 5).
crash-real:
	BIGFLEET_CRASH_REAL_ITERATIONS=300 $(CARGO) test -p bigfleet-proxmox --test crash_real -- --nocapture

# Failover between two replicas on one PostgreSQL state, on pve-sim: 20
# kills (-9) of the leader in a 16-way burst of Creates, with the default
# lease; prints the longest takeover (the test suite runs 2 rounds).
failover:
	scripts/pg-throwaway.sh run -- env BIGFLEET_FAILOVER_ROUNDS=20 $(CARGO) test -p bigfleet-proxmox --test integration failover::failover_under_a_burst -- --nocapture

# The suite must be able to fail: deliberately broken engines are caught.
mutation-check:
	$(CARGO) test -p conformance --features mutants --test mutants
