# snowrdma: `make` builds the library and the C examples (including the
# kv_open API's `application` and its `client` symlink) against the committed
# headers; `make header` regenerates them from the source;
# `make run` starts a kv_server and runs a short kv_client benchmark against
# it (Soft-RoCE in a VM where the host has no RDMA device); `make test` runs
# everything.

CARGO   ?= cargo
PROFILE ?= release
CC      ?= cc
CXX     ?= c++
CFLAGS  ?= -O2 -g
CFLAGS  += -Wall -Wextra -Werror -I include
CXXFLAGS ?= -O2 -g
CXXFLAGS += -std=c++17 -Wall -Wextra -Werror -I include
# Where `make install` puts things ($(DESTDIR) in front of each).
PREFIX     ?= /usr/local
LIBDIR     ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig
# Where `make bench` writes its table as JSON.
BENCH_JSON ?= target/bench/results.json

# Cargo's output for $(PROFILE).
BUILDDIR   := target/$(PROFILE)
EXAMPLEDIR := target/c-examples
RDMA_LIBS  := -lrdmacm -libverbs -lpthread
CARGO_FLAGS := $(if $(filter release,$(PROFILE)),--release,)

.PHONY: all lib header check-header c-examples c-examples-asan run deps lint host-test device-test test install bench trace-doorbells clean

all: lib c-examples

# The SONAME is libsnowrdma.so.$(SOVERSION) (build.rs); programs linked
# here find it through this link.
SOVERSION := $(shell sed -n 's/^version = "\([0-9]*\)\..*/\1/p' Cargo.toml | head -1)
VERSION   := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)

lib:
	$(CARGO) build $(CARGO_FLAGS)
	ln -sf libsnowrdma.so $(BUILDDIR)/libsnowrdma.so.$(SOVERSION)

header:
	scripts/headers.sh include

# The committed headers must be what the source generates.
check-header:
	scripts/headers.sh target/header-check
	diff -u include/rdma.h target/header-check/rdma.h
	diff -u include/kv_store.h target/header-check/kv_store.h
	diff -u include/snowrdma/broker.h target/header-check/snowrdma/broker.h

C_PROGRAMS := devices layout echo_server client misuse kv_check handles callbacks broker_example
# C++ programs (the broker's header-only C++ API).
CXX_PROGRAMS := broker_example_cpp
# The C programs again, built with AddressSanitizer and UBSan (any finding
# fails the program); the device tests run a few of them.
ASAN_EXAMPLEDIR := target/c-examples-asan
ASAN_CFLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer

c-examples: lib
	@mkdir -p $(EXAMPLEDIR)
	for p in $(C_PROGRAMS); do \
	    $(CC) $(CFLAGS) c-examples/$$p.c -o $(EXAMPLEDIR)/$$p \
	        -L$(BUILDDIR) -Wl,-rpath,$(abspath $(BUILDDIR)) -lsnowrdma -lpthread || exit 1; \
	done
	$(CC) $(CFLAGS) c-examples/devices.c -o $(EXAMPLEDIR)/devices-static \
	    -L$(BUILDDIR) -Wl,-Bstatic -lsnowrdma -Wl,-Bdynamic $(RDMA_LIBS)
	# The legacy compile line, dynamic and static.
	$(CC) $(CFLAGS) c-examples/legacy_style.c -o $(EXAMPLEDIR)/legacy_style -I include \
	    -L$(BUILDDIR) -Wl,-rpath,$(abspath $(BUILDDIR)) -lsnowrdma -lrdmacm -libverbs -lpthread
	$(CC) $(CFLAGS) c-examples/legacy_style.c -o $(EXAMPLEDIR)/legacy_style-static -I include \
	    -L$(BUILDDIR) -Wl,-Bstatic -lsnowrdma -Wl,-Bdynamic -lrdmacm -libverbs -lpthread
	# The kv_open API's legacy program: application, and client -> application.
	@mkdir -p $(EXAMPLEDIR)/kv-app
	$(CC) $(CFLAGS) c-examples/kv-app/application.c c-examples/kv-app/client.c \
	    -o $(EXAMPLEDIR)/kv-app/application \
	    -L$(BUILDDIR) -Wl,-rpath,$(abspath $(BUILDDIR)) -lsnowrdma -lpthread
	ln -sf application $(EXAMPLEDIR)/kv-app/client
	for p in $(CXX_PROGRAMS); do \
	    $(CXX) $(CXXFLAGS) c-examples/$${p%_cpp}.cpp -o $(EXAMPLEDIR)/$$p \
	        -L$(BUILDDIR) -Wl,-rpath,$(abspath $(BUILDDIR)) -lsnowrdma -lpthread || exit 1; \
	done

c-examples-asan: lib
	@mkdir -p $(ASAN_EXAMPLEDIR)
	for p in $(C_PROGRAMS); do \
	    $(CC) $(CFLAGS) $(ASAN_CFLAGS) c-examples/$$p.c -o $(ASAN_EXAMPLEDIR)/$$p \
	        -L$(BUILDDIR) -Wl,-rpath,$(abspath $(BUILDDIR)) -lsnowrdma -lpthread || exit 1; \
	done
	for p in $(CXX_PROGRAMS); do \
	    $(CXX) $(CXXFLAGS) $(ASAN_CFLAGS) c-examples/$${p%_cpp}.cpp -o $(ASAN_EXAMPLEDIR)/$$p \
	        -L$(BUILDDIR) -Wl,-rpath,$(abspath $(BUILDDIR)) -lsnowrdma -lpthread || exit 1; \
	done

deps:
	scripts/install-deps.sh

# The main job: a kv_server and a short kv_client benchmark against it.
run: deps all
	scripts/rdma-run.sh scripts/kv-demo.sh $(BUILDDIR)

lint:
	$(CARGO) fmt --check
	$(CARGO) clippy --all-targets -- -D warnings
	$(CARGO) clippy --all-targets --all-features -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --no-deps

# Needs cargo, cc, nm, readelf, pkg-config, libibverbs-dev and librdmacm-dev
# (scripts/install-deps.sh installs them; `make test` runs it first), and
# for the TSan run a nightly toolchain with rust-src (skipped without).
INSTALL_CHECK := $(abspath target/install-check)
host-test:
	@echo "host-test: needs cargo, cc, c++, nm, readelf, pkg-config, libibverbs-dev, librdmacm-dev (scripts/install-deps.sh)"
	$(CARGO) test
	python3 -m unittest discover -s scripts -p 'test_*.py'
	scripts/tsan.sh
	# The library alone, as a Rust program with default features off uses it:
	# none of the programs' crates.
	$(CARGO) check --lib --no-default-features
	! $(CARGO) tree --no-default-features -e normal | grep -E ' (clap|rustyline|indicatif|signal-hook) v'
	$(EXAMPLEDIR)/layout
	$(EXAMPLEDIR)/devices
	$(EXAMPLEDIR)/devices-static
	scripts/check-symbols.sh $(BUILDDIR)/libsnowrdma.so include/rdma.h include/kv_store.h include/snowrdma/broker.h
	readelf -d $(BUILDDIR)/libsnowrdma.so | grep -q 'SONAME.*\[libsnowrdma.so.$(SOVERSION)\]'
	scripts/check-install.sh $(INSTALL_CHECK)

device-test:
	scripts/device-tests.sh

test: deps
	$(MAKE) lint check-header
	$(MAKE) PROFILE=debug c-examples c-examples-asan
	$(MAKE) PROFILE=debug host-test
	$(MAKE) PROFILE=debug device-test

# Every case against perftest on the same device, interleaved, 5 repetitions
# (SNOWRDMA_BENCH_REPS); prints the table and writes it to $(BENCH_JSON).
bench: deps c-examples
	$(CARGO) build --release
	scripts/rdma-run.sh scripts/bench.sh target/bench/results.txt
	target/release/snowrdma-bench report target/bench/results.txt --json $(BENCH_JSON)

# Where a ping-pong's round trip goes on Soft-RoCE (kernel or user space),
# perftest's and ours, per speed level of the emulated CPU (docs/costs.md).
trace-doorbells: deps c-examples
	$(CARGO) build --release
	scripts/rdma-run.sh scripts/trace-doorbells.sh $(ROUNDS)

# Installs the library (libsnowrdma.so.$(VERSION), its SONAME link
# libsnowrdma.so.$(SOVERSION) and the link-time libsnowrdma.so; libsnowrdma.a),
# the committed headers (rdma.h, kv_store.h, snowrdma/rdma.h, snowrdma/broker.h
# and .hpp) and snowrdma.pc
# pointing at them: `pkg-config --cflags --libs [--static] snowrdma`.
# Installed files have no debug info (the build keeps its own).
install: lib
	install -d $(DESTDIR)$(LIBDIR) $(DESTDIR)$(PKGCONFIGDIR) $(DESTDIR)$(INCLUDEDIR)/snowrdma
	install -m 755 $(BUILDDIR)/libsnowrdma.so $(DESTDIR)$(LIBDIR)/libsnowrdma.so.$(VERSION)
	strip --strip-debug $(DESTDIR)$(LIBDIR)/libsnowrdma.so.$(VERSION)
	ln -sf libsnowrdma.so.$(VERSION) $(DESTDIR)$(LIBDIR)/libsnowrdma.so.$(SOVERSION)
	ln -sf libsnowrdma.so.$(SOVERSION) $(DESTDIR)$(LIBDIR)/libsnowrdma.so
	install -m 644 $(BUILDDIR)/libsnowrdma.a $(DESTDIR)$(LIBDIR)/
	strip --strip-debug $(DESTDIR)$(LIBDIR)/libsnowrdma.a
	install -m 644 include/rdma.h include/kv_store.h $(DESTDIR)$(INCLUDEDIR)/
	install -m 644 include/snowrdma/rdma.h include/snowrdma/broker.h include/snowrdma/broker.hpp \
	    $(DESTDIR)$(INCLUDEDIR)/snowrdma/
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@LIBDIR@|$(LIBDIR)|' -e 's|@INCLUDEDIR@|$(INCLUDEDIR)|' \
	    -e 's|@VERSION@|$(VERSION)|' -e '/^#/d' snowrdma.pc.in > $(DESTDIR)$(PKGCONFIGDIR)/snowrdma.pc

clean:
	$(CARGO) clean
