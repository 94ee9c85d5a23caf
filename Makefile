# snowrdma: `make` builds the library, the header and the C examples;
# `make run` shows the device and verifies every operation on it (Soft-RoCE in
# a VM where the host has no RDMA device); `make test` runs everything.

CARGO   ?= cargo
PROFILE ?= release
CC      ?= cc
CFLAGS  ?= -O2 -g
CFLAGS  += -Wall -Wextra -Werror -I include
PREFIX  ?= /usr/local

LIBDIR     := target/$(PROFILE)
EXAMPLEDIR := target/c-examples
RDMA_LIBS  := -lrdmacm -libverbs -lpthread
CARGO_FLAGS := $(if $(filter release,$(PROFILE)),--release,)

.PHONY: all lib header check-header c-examples run deps lint host-test device-test test clean

all: lib header c-examples

lib:
	$(CARGO) build $(CARGO_FLAGS)

header:
	cbindgen -q --config cbindgen.toml --crate snowrdma --output include/rdma.h

# The committed header must be what the source generates.
check-header:
	@mkdir -p target
	cbindgen -q --config cbindgen.toml --crate snowrdma --output target/rdma.h.check
	diff -u include/rdma.h target/rdma.h.check

C_PROGRAMS := devices layout echo_server client misuse

c-examples: lib
	@mkdir -p $(EXAMPLEDIR)
	for p in $(C_PROGRAMS); do \
	    $(CC) $(CFLAGS) c-examples/$$p.c -o $(EXAMPLEDIR)/$$p \
	        -L$(LIBDIR) -Wl,-rpath,$(abspath $(LIBDIR)) -lsnowrdma -lpthread || exit 1; \
	done
	$(CC) $(CFLAGS) c-examples/devices.c -o $(EXAMPLEDIR)/devices-static \
	    -L$(LIBDIR) -Wl,-Bstatic -lsnowrdma -Wl,-Bdynamic $(RDMA_LIBS)
	# The legacy compile line, dynamic and static.
	$(CC) $(CFLAGS) c-examples/legacy_style.c -o $(EXAMPLEDIR)/legacy_style -I include \
	    -L$(LIBDIR) -Wl,-rpath,$(abspath $(LIBDIR)) -lsnowrdma -lrdmacm -libverbs -lpthread
	$(CC) $(CFLAGS) c-examples/legacy_style.c -o $(EXAMPLEDIR)/legacy_style-static -I include \
	    -L$(LIBDIR) -Wl,-Bstatic -lsnowrdma -Wl,-Bdynamic -lrdmacm -libverbs -lpthread

deps:
	scripts/install-deps.sh

run: deps all
	scripts/rdma-run.sh $(LIBDIR)/snowrdma-probe

lint:
	$(CARGO) fmt --check
	$(CARGO) clippy --all-targets -- -D warnings

host-test:
	$(CARGO) test
	$(EXAMPLEDIR)/layout
	$(EXAMPLEDIR)/devices
	$(EXAMPLEDIR)/devices-static
	scripts/check-symbols.sh $(LIBDIR)/libsnowrdma.so include/rdma.h

device-test:
	scripts/device-tests.sh

test: deps
	$(MAKE) lint check-header
	$(MAKE) PROFILE=debug c-examples
	$(MAKE) PROFILE=debug host-test
	$(MAKE) PROFILE=debug device-test

clean:
	$(CARGO) clean
