# cachefs developer entry points. Every target installs what it needs on a fresh
# Debian machine (as root) and is quick when everything is already there.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DIST_DIR ?= dist
IMAGE    ?= localhost/cachefs
# libfuse3-dev, pkg-config, gcc, libc6-dev, python3-dev: pip compiles pyfuse3 (which cachefs
# uses only to mount) against the system's libfuse 3, and cachefs's own C extensions (libssl-dev:
# libcrypto's MD5 for cachefs/s3/_wire.c);
# prometheus: the real scraper of tests/test_prometheus.py (its service is disabled below);
# buildah, debootstrap: make image (tests/test_image.py)
APT_PACKAGES := fuse3 libfuse3-dev pkg-config s3fs shellcheck gcc libc6-dev python3-dev libssl-dev \
	prometheus buildah debootstrap

.PHONY: demo test check lint typecheck test-fast bench bench-quick bench-cluster deps dist image \
	dist-now image-now clean

## demo: a local S3 server with a sample dataset, mounted and read cold then warm
demo: deps
	$(BIN)/python -m benchmarks.demo

## test: lint + type gate, then the whole test suite (real FUSE mounts, real S3 servers)
test: check
	@$(BIN)/python -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; \
	exit $$rc

## test-fast: the suite without tests marked slow
test-fast: deps
	$(BIN)/python -m pytest -q -m "not slow"

## check: ruff and mypy
check: lint typecheck

lint: deps
	$(BIN)/ruff check cachefs tests benchmarks

typecheck: deps
	$(BIN)/mypy

## bench: the full remote-vs-co-located benchmark (minutes); bench-quick: seconds
bench: deps
	$(BIN)/python -m benchmarks.run

bench-quick: deps
	$(BIN)/python -m benchmarks.run --quick

## bench-cluster: four nodes with and without a shared cache tier (minutes)
bench-cluster: deps
	$(BIN)/python -m benchmarks.cluster

# dist and image build in this checkout (cachefs.egg-info, the sdist's release tree, build/):
# two at once would remove each other's files, so each holds build/.checkout.lock (flock).
LOCKED := mkdir -p build && flock build/.checkout.lock $(MAKE) --no-print-directory

## dist: wheel and sdist in dist/, versioned from git (setuptools-scm); older ones removed
dist: deps
	@$(LOCKED) dist-now

## image: the container image localhost/cachefs:VERSION with buildah, from the wheel of make dist
## (base: a local debootstrap of Debian bookworm, or BASE=IMAGE); no registry needed
image: deps
	@$(LOCKED) dist-now image-now

dist-now:
	rm -f $(DIST_DIR)/cachefs-*
	$(BIN)/python -m build --outdir $(DIST_DIR) .
	@rm -rf cachefs.egg-info  # setuptools leaves it; a stale one would shadow the venv's metadata
	@ls -1 $(DIST_DIR)/cachefs-*

image-now:
	BASE="$(BASE)" scripts/build-image.sh $(DIST_DIR) $(IMAGE)

deps: $(STAMP)

$(STAMP): pyproject.toml cachefs/fuse/_native.c cachefs/cache/_cachefile.c cachefs/s3/_wire.c
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing apt packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
	@# Debian starts prometheus (:9090) and node-exporter (:9100) as services where systemd
	@# runs; tests start their own Prometheus and want no system one scraping or bound.
	@if [ -d /run/systemd/system ]; then \
	  systemctl disable --now prometheus prometheus-node-exporter >/dev/null 2>&1 || true; fi
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	@rm -rf cachefs.egg-info  # the editable install's metadata lives in the venv
	@touch $@

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
