# pagefleet — `make demo` and `make test` work on a fresh Debian machine (as
# root, or with sudo for apt): every system and toolchain dependency is
# installed here, never by hand.

SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)
CARGO ?= cargo
# Debian packages: memcached is the peer page store in the memory-server
# benchmark, libmemcached-tools and python3-pymemcache the real clients of
# the kv guest;
# python3-venv hosts the plotting environment; iproute2 builds the testbed;
# util-linux has mkswap/swapon/setpriv for the swap baselines and tests and
# nsenter for the testbed; ksmtuned is the peer of the KSM controller;
# prometheus (and promtool) scrape a lab and check the rules; chromium and
# chromium-driver run the dashboard's browser test; syslinux, mtools and
# dosfstools make the VM test image's boot disk; mmdebstrap and fdisk
# (sfdisk) build the Debian VM image; libvirt-clients (virsh) writes the
# domain definitions the --domain-xml test starts.
# Packages are installed without starting their services (policy-rc.d):
# a ksmtuned daemon would fight the KSM tests over /sys/kernel/mm/ksm.
APT_PKGS := build-essential pkg-config python3 python3-venv memcached libmemcached-tools python3-pymemcache iproute2 util-linux \
            qemu-utils libnbd-bin python3-libnbd nbdkit fio qemu-system-x86 cpio ksmtuned \
            etcd-server etcd-client protobuf-compiler libprotobuf-dev prometheus chromium chromium-driver \
            syslinux syslinux-common mtools dosfstools mmdebstrap fdisk libvirt-clients ovmf
VENV := .venv
FUZZ_SECONDS ?= 30

.PHONY: all deps deps-apt deps-rust deps-python build guest vm lint test test-unit fuzz-smoke fuzz-campaign demo demo-vm bench install deb clean

all: build

deps: deps-apt deps-rust deps-python

deps-apt:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  pol=""; [ -e /usr/sbin/policy-rc.d ] || { pol=/usr/sbin/policy-rc.d; printf '#!/bin/sh\nexit 101\n' | $$SUDO tee $$pol >/dev/null; $$SUDO chmod +x $$pol; }; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; rc=$$?; \
	  [ -z "$$pol" ] || $$SUDO rm -f $$pol; exit $$rc; \
	fi

deps-rust:
	@command -v $(CARGO) >/dev/null || { echo "cargo not found: install Rust (rustup) first"; exit 1; }
	@command -v cargo-fuzz >/dev/null || { echo "installing cargo-fuzz"; $(CARGO) install cargo-fuzz --locked --quiet; }
	@$(CARGO) clippy --version >/dev/null 2>&1 || { command -v rustup >/dev/null && rustup component add clippy; }

deps-python: $(VENV)/.ok
$(VENV)/.ok: bench/requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r bench/requirements.txt
	touch $@

build: deps
	$(CARGO) build --release --workspace

# The swap-test guest: Debian's cloud kernel and busybox-static, unpacked
# (not installed), plus a static test program, in target/guest.
guest: deps
	crates/systest/guest/build.sh target/guest

# The VM guest images, in target/vm: the same kernel, busybox and vmwork (a
# memory workload that checks every value it reads) for `pagefleet run vm`,
# `guest start ... -- vm`, the VM tests and `bench vm-migration`; and
# debian.qcow2, a Debian system with systemd and memcached booting through
# the firmware from its own disk (the demo's VM, the real-VM tests and
# drills). Each is built once per machine and kept.
vm: deps
	crates/systest/vm/build.sh target/vm
	crates/systest/vm/build-debian.sh target/vm

# Every test: a short fuzz run of the server and the decoders, then unit,
# property, integration and testbed tests (real daemons on loopback and in
# network namespaces, the guest swapping to the block device, the
# benchmarks' smoke runs).
test: build guest vm lint fuzz-smoke test-unit

# Clippy with the workspace lints (SAFETY comments on every unsafe block,
# unsafe operations marked inside unsafe fns, documented library APIs),
# every warning an error; the Prometheus alerting rules checked and their
# unit tests run by promtool.
lint: deps
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	promtool check rules packaging/prometheus/rules.yml
	cd packaging/prometheus && promtool test rules rules.test.yml

# Doc-tests run only where there are some (the uffd crate's compile_fail
# check that safe code cannot register memory); the last line sums every
# runner's result so the closing line counts the whole suite.
test-unit:
	@mkdir -p target
	set -o pipefail; $(CARGO) test --release --workspace --no-fail-fast --lib --bins --tests 2>&1 | tee target/test.log
	set -o pipefail; $(CARGO) test --release -p pagefleet-uffd --doc 2>&1 | tee -a target/test.log
	@awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($$(i+1) ~ /^passed/) p += $$i; if ($$(i+1) ~ /^failed/) f += $$i } } \
	  END { printf "summary: %d passed, %d failed\n", p, f }' target/test.log

fuzz-smoke:
	fuzz/run.sh server_session $(FUZZ_SECONDS)
	fuzz/run.sh proto_decode $$(( $(FUZZ_SECONDS) / 2 ))
	fuzz/run.sh http_auth $$(( $(FUZZ_SECONDS) / 2 ))
	fuzz/run.sh nbd $$(( $(FUZZ_SECONDS) / 2 ))
	fuzz/run.sh kv_text $$(( $(FUZZ_SECONDS) / 2 ))
	fuzz/run.sh qmp_reply $$(( $(FUZZ_SECONDS) / 2 ))
	fuzz/run.sh migration_stream $$(( $(FUZZ_SECONDS) / 2 ))
	fuzz/run.sh vm_shim $$(( $(FUZZ_SECONDS) / 2 ))
	fuzz/run.sh config $$(( $(FUZZ_SECONDS) / 2 ))
	fuzz/run.sh registry_records $$(( $(FUZZ_SECONDS) / 2 ))

# Every fuzz target for FUZZ_CAMPAIGN_SECONDS each (default 30 minutes):
# make fuzz-campaign FUZZ_CAMPAIGN_SECONDS=1800
FUZZ_CAMPAIGN_SECONDS ?= 1800
fuzz-campaign: deps
	for t in server_session proto_decode http_auth nbd kv_text qmp_reply migration_stream vm_shim config registry_records; do fuzz/run.sh $$t $(FUZZ_CAMPAIGN_SECONDS) || exit 1; done

# Install what `make build` built (run that first: install only copies):
#   make build && sudo make install [PREFIX=/usr/local] [DESTDIR=/staging]
# binaries in PREFIX/bin, the VM shim in PREFIX/lib/pagefleet (where
# pagefleetd's runners look for it), the systemd unit in
# PREFIX/lib/systemd/system, the sample config in /etc/pagefleet (never
# over an existing one), the docs in PREFIX/share/doc/pagefleet, manual
# pages (pagefleet(1) and its subcommands, pagefleetd(8)) and bash, zsh and
# fish completions under PREFIX/share.
PREFIX ?= /usr/local
SYSCONFDIR ?= /etc
BINDIR = $(PREFIX)/bin
PKGLIBDIR = $(PREFIX)/lib/pagefleet
UNITDIR = $(PREFIX)/lib/systemd/system
DOCDIR = $(PREFIX)/share/doc/pagefleet
MANDIR = $(PREFIX)/share/man
COMPDIR = $(PREFIX)/share
install:
	@for f in target/release/pagefleet target/release/pagefleetd target/release/pagefleet-runner target/release/libpagefleet_vmshim.so; do \
	  [ -f $$f ] || { echo "install: $$f missing: run make build first" >&2; exit 1; }; done
	install -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(PKGLIBDIR) $(DESTDIR)$(UNITDIR) \
	  $(DESTDIR)$(SYSCONFDIR)/pagefleet $(DESTDIR)$(DOCDIR)/docs
	install -m 0755 target/release/pagefleet target/release/pagefleetd target/release/pagefleet-runner $(DESTDIR)$(BINDIR)/
	install -m 0644 target/release/libpagefleet_vmshim.so $(DESTDIR)$(PKGLIBDIR)/
	sed -e 's|/usr/local/bin/|$(BINDIR)/|g' -e 's|/usr/local/share/doc/|$(PREFIX)/share/doc/|g' \
	  -e 's|/etc/pagefleet|$(SYSCONFDIR)/pagefleet|g' packaging/pagefleetd.service > $(DESTDIR)$(UNITDIR)/pagefleetd.service
	chmod 0644 $(DESTDIR)$(UNITDIR)/pagefleetd.service
	[ -e $(DESTDIR)$(SYSCONFDIR)/pagefleet/pagefleetd.toml ] || \
	  sed -e 's|/usr/local/bin/|$(BINDIR)/|g' -e 's|/etc/pagefleet|$(SYSCONFDIR)/pagefleet|g' packaging/pagefleetd.toml \
	  > $(DESTDIR)$(SYSCONFDIR)/pagefleet/pagefleetd.toml
	install -m 0644 README.md $(DESTDIR)$(DOCDIR)/
	install -m 0644 docs/*.md $(DESTDIR)$(DOCDIR)/docs/
	install -m 0644 packaging/prometheus/rules.yml $(DESTDIR)$(DOCDIR)/prometheus-rules.yml
	install -m 0644 packaging/grafana/pagefleet.json $(DESTDIR)$(DOCDIR)/grafana-dashboard.json
	install -d $(DESTDIR)$(MANDIR)/man1 $(DESTDIR)$(MANDIR)/man8 $(DESTDIR)$(COMPDIR)/bash-completion/completions \
	  $(DESTDIR)$(COMPDIR)/zsh/vendor-completions $(DESTDIR)$(COMPDIR)/fish/vendor_completions.d
	target/release/pagefleet man $(DESTDIR)$(MANDIR)/man1
	target/release/pagefleetd --man > $(DESTDIR)$(MANDIR)/man8/pagefleetd.8
	target/release/pagefleet completions bash > $(DESTDIR)$(COMPDIR)/bash-completion/completions/pagefleet
	target/release/pagefleet completions zsh > $(DESTDIR)$(COMPDIR)/zsh/vendor-completions/_pagefleet
	target/release/pagefleet completions fish > $(DESTDIR)$(COMPDIR)/fish/vendor_completions.d/pagefleet.fish

# A Debian package of what `make build` built: `make install PREFIX=/usr`
# into target/deb/root, the control files from packaging/debian, then
# dpkg-deb: target/pagefleet_VERSION_ARCH.deb.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
DEB_ROOT = target/deb/root
deb:
	rm -rf $(DEB_ROOT) && mkdir -p $(DEB_ROOT)/DEBIAN
	$(MAKE) install DESTDIR=$(CURDIR)/$(DEB_ROOT) PREFIX=/usr
	arch=$$(dpkg --print-architecture); \
	  sed -e 's/@VERSION@/$(VERSION)/' -e "s/@ARCH@/$$arch/" packaging/debian/control > $(DEB_ROOT)/DEBIAN/control && \
	  install -m 0644 packaging/debian/conffiles $(DEB_ROOT)/DEBIAN/ && \
	  install -m 0755 packaging/debian/postinst packaging/debian/prerm packaging/debian/postrm $(DEB_ROOT)/DEBIAN/ && \
	  dpkg-deb --root-owner-group --build $(DEB_ROOT) target/pagefleet_$(VERSION)_$$arch.deb

# The split-migration demo on a 4-host testbed (root: network namespaces).
demo: build
	./target/release/pagefleet demo

# The same story with the Debian VM (memcached on its own address; the
# clients check every value; --vm-image vmwork for the test image).
demo-vm: build vm
	./target/release/pagefleet demo --vm

# make bench BENCH=memserver|paging|migration
BENCH ?= memserver
bench: build
	./target/release/pagefleet bench $(BENCH)

clean:
	$(CARGO) clean
	rm -rf fuzz/target bench-results $(VENV)
