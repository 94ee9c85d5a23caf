#!/usr/bin/env bash
# `make install` as a distribution package runs it (DESTDIR, PREFIX and a
# multiarch LIBDIR), then checks the staged tree: the files and links are
# where they belong, snowrdma.pc points at them, the installed library has no
# debug info, and a C program links through pkg-config both dynamically and
# statically (against libsnowrdma.a, with `pkg-config --static --libs`).
#
#   scripts/check-install.sh <scratch dir>     (make's variables, e.g. PROFILE, via MAKEFLAGS)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=$1
prefix=/usr
libdir=/usr/lib/check-multiarch
rm -rf "$dest"
${MAKE:-make} --no-print-directory install DESTDIR="$dest" PREFIX=$prefix LIBDIR=$libdir \
    INCLUDEDIR=$prefix/include PKGCONFIGDIR=$libdir/pkgconfig
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
major=${version%%.*}
fail() { echo "check-install: $*" >&2; exit 1; }

lib=$dest$libdir
for f in "$lib/libsnowrdma.so.$version" "$lib/libsnowrdma.a" "$lib/pkgconfig/snowrdma.pc" \
    "$dest$prefix/include/rdma.h" "$dest$prefix/include/kv_store.h" "$dest$prefix/include/snowrdma/rdma.h"; do
    [ -f "$f" ] || fail "missing $f"
done
[ "$(readlink "$lib/libsnowrdma.so.$major")" = "libsnowrdma.so.$version" ] || fail "bad link libsnowrdma.so.$major"
[ "$(readlink "$lib/libsnowrdma.so")" = "libsnowrdma.so.$major" ] || fail "bad link libsnowrdma.so"
! readelf -S "$lib/libsnowrdma.so.$version" | grep -q '\.debug_info' || fail "the installed library has debug info"

# The .pc file names the final paths; a build against the staged tree sees
# them with the sysroot in front.
export PKG_CONFIG_PATH=$lib/pkgconfig
[ "$(pkg-config --variable=libdir snowrdma)" = "$libdir" ] || fail "snowrdma.pc: libdir is not $libdir"
[ "$(pkg-config --variable=includedir snowrdma)" = "$prefix/include" ] || fail "snowrdma.pc: includedir is not $prefix/include"
[ "$(pkg-config --modversion snowrdma)" = "$version" ] || fail "snowrdma.pc: version is not $version"
export PKG_CONFIG_SYSROOT_DIR=$dest

cc=${CC:-cc}
$cc -Wall -Wextra -Werror c-examples/layout.c -o "$dest/layout" \
    $(pkg-config --cflags --libs snowrdma) -Wl,-rpath,"$lib"
"$dest/layout" >/dev/null || fail "the dynamically linked program failed"
# -l:libsnowrdma.a makes the linker take the archive where the .so sits beside it.
$cc -Wall -Wextra -Werror c-examples/layout.c -o "$dest/layout-static" \
    $(pkg-config --cflags snowrdma) $(pkg-config --static --libs snowrdma | sed 's/-lsnowrdma\b/-l:libsnowrdma.a/')
! readelf -d "$dest/layout-static" | grep -q 'NEEDED.*libsnowrdma' || fail "the static program needs libsnowrdma.so"
"$dest/layout-static" >/dev/null || fail "the statically linked program failed"
echo "check-install: $dest: files, links, snowrdma.pc, dynamic and static links through pkg-config all right"
