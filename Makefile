# Entry points for builds, tests and certification. See README.md.
CARGO ?= cargo

.PHONY: build build-proxmox run-fake test lint fmt

build:
	$(CARGO) build --workspace

# Release build of the provider at bin/proxmox.
build-proxmox:
	$(CARGO) build --release -p bigfleet-proxmox
	mkdir -p bin
	cp target/release/bigfleet-proxmox bin/proxmox

# The provider on the in-memory fake backend (no Proxmox cluster needed).
run-fake:
	$(CARGO) run -p bigfleet-proxmox -- --use-fake-backend --addr 127.0.0.1:9000 --metrics-addr 127.0.0.1:9090

# Everything CI runs.
test: lint
	$(CARGO) test --workspace

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all
