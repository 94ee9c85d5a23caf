//! The counted side of the bench: a counting allocator, and a window around
//! a case's steady-state loop that writes what each operation cost (the
//! library's [`snowrdma::costs`] and the allocator's counts, per operation)
//! to the file named by `SNOWRDMA_BENCH_COSTS`, one line per figure:
//!
//! ```text
//! <case> <caller|rest> <figure> <per-operation value>
//! ```
//!
//! `caller` is the thread that runs the loop (the client's side: its posts,
//! copies and allocations); `rest` is every other thread of the process (the
//! in-process server and the runtimes' completion threads).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use snowrdma::costs::{self, Costs, Counter};

/// Counts every allocation and free of the process, and the calling
/// thread's own.
pub(crate) struct CountingAlloc;

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static FREES: AtomicU64 = AtomicU64::new(0);

thread_local! {
    // Const-initialised and without a destructor: usable inside the
    // allocator without allocating.
    static MY_ALLOCS: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
    // Set while this thread prints a traced allocation's backtrace, whose
    // own allocations are not traced.
    static TRACING: Cell<bool> = const { Cell::new(false) };
}

/// How many more allocations inside the window print their backtrace
/// (`SNOWRDMA_BENCH_TRACE_ALLOCS=<n>`, read when the window opens): where
/// an allocation the report counts comes from.
static TRACE_LEFT: AtomicU64 = AtomicU64::new(0);

fn trace() {
    if TRACE_LEFT.load(Ordering::Relaxed) == 0 || TRACING.try_with(Cell::get).unwrap_or(true) {
        return;
    }
    let taken = TRACE_LEFT.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    if taken.is_err() {
        return;
    }
    TRACING.with(|t| t.set(true));
    let thread = std::thread::current();
    eprintln!(
        "bench: allocation in the window on thread {:?}:\n{}",
        thread.name().unwrap_or("?"),
        std::backtrace::Backtrace::force_capture()
    );
    TRACING.with(|t| t.set(false));
}

fn count(alloc: u64, free: u64) {
    ALLOCS.fetch_add(alloc, Ordering::Relaxed);
    FREES.fetch_add(free, Ordering::Relaxed);
    let _ = MY_ALLOCS.try_with(|c| {
        let (a, f) = c.get();
        c.set((a + alloc, f + free));
    });
}

// SAFETY: every call is passed to the system allocator unchanged.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(1, 0);
        trace();
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(1, 0);
        trace();
        System.alloc_zeroed(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(0, 1);
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // A move to a new block: one allocation and one free.
        count(1, 1);
        trace();
        System.realloc(ptr, layout, new_size)
    }
}

/// The case being run, named in the lines written.
static CASE: OnceLock<String> = OnceLock::new();

pub(crate) fn set_case(name: &str) {
    let _ = CASE.set(name.to_string());
}

#[derive(Clone, Copy)]
struct Counts {
    lib: Costs,
    allocs: u64,
    frees: u64,
}

fn all() -> Counts {
    Counts {
        lib: costs::snapshot(),
        allocs: ALLOCS.load(Ordering::Relaxed),
        frees: FREES.load(Ordering::Relaxed),
    }
}

fn mine() -> Counts {
    let (allocs, frees) = MY_ALLOCS.with(Cell::get);
    Counts {
        lib: costs::this_thread(),
        allocs,
        frees,
    }
}

/// Counts from [`Window::open`] to [`Window::close`].
pub(crate) struct Window {
    all: Counts,
    mine: Counts,
}

impl Window {
    /// Opens the window; call it after the warm-up, just before the loop.
    pub(crate) fn open() -> Window {
        // Read before the counts are taken: reading it allocates.
        let trace: Option<u64> = std::env::var("SNOWRDMA_BENCH_TRACE_ALLOCS")
            .ok()
            .and_then(|v| v.parse().ok());
        let w = Window {
            mine: mine(),
            all: all(),
        };
        snowrdma_cost_window_open();
        if let Some(n) = trace {
            TRACE_LEFT.store(n, Ordering::Relaxed);
        }
        w
    }

    /// Closes the window over `ops` operations and writes their cost.
    pub(crate) fn close(self, ops: usize) {
        let (all, mine) = (all(), mine());
        TRACE_LEFT.store(0, Ordering::Relaxed);
        snowrdma_cost_window_close(ops);
        let Ok(path) = std::env::var("SNOWRDMA_BENCH_COSTS") else {
            return;
        };
        let case = CASE.get().map_or("?", String::as_str);
        let ops = ops.max(1) as f64;
        let caller = diff(&mine, &self.mine);
        let everyone = diff(&all, &self.all);
        // How many operations the window held, for counts taken outside
        // (perf's, in scripts/bench.sh).
        let mut out = format!("{case} both window_ops {ops}\n");
        for (side, d) in [("caller", &caller), ("rest", &minus(&everyone, &caller))] {
            for (figure, v) in d {
                out.push_str(&format!("{case} {side} {figure} {:.3}\n", *v as f64 / ops));
            }
        }
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(out.as_bytes()));
        if let Err(e) = written {
            eprintln!("bench: cannot write the cost to {path}: {e}");
        }
    }
}

// The window's edges, marked for the tools `scripts/bench.sh` runs the
// case under: a system call that names the edge for strace (which counts
// every thread's calls between `open` and `close/<ops>`), and a function of
// its own for callgrind (which zeroes its counts on entering the first and
// dumps them on entering the second).

// Under `perf stat --control` (SNOWRDMA_BENCH_PERF_CTL and _ACK name its
// FIFOs) the window enables and disables perf's counters, waiting for each
// acknowledgement: perf counts only what the window holds, plus some of
// the handshake's own writes and reads (perf applies a command when it
// reads it, so how many fall inside varies), which it counts apart by
// their descriptors (`PERF_CTL_FD`, `PERF_ACK_FD`) to take them off.

#[no_mangle]
#[inline(never)]
extern "C" fn snowrdma_cost_window_open() {
    let _ = std::fs::metadata("/snowrdma-cost-window/open");
    perf_control("enable");
}

#[no_mangle]
#[inline(never)]
extern "C" fn snowrdma_cost_window_close(ops: usize) {
    perf_control("disable");
    let _ = std::fs::metadata(format!("/snowrdma-cost-window/close/{ops}"));
}

/// The descriptors perf's control and acknowledgement FIFOs are kept at
/// (`scripts/bench.sh` filters on them).
const PERF_CTL_FD: i32 = 1000;
const PERF_ACK_FD: i32 = 1001;

/// perf's FIFOs, opened once, before the first window (their opening is
/// never counted), at [`PERF_CTL_FD`] and [`PERF_ACK_FD`].
fn perf_fifos() -> Option<&'static (File, File)> {
    static FIFOS: OnceLock<Option<(File, File)>> = OnceLock::new();
    FIFOS
        .get_or_init(|| {
            let ctl = std::env::var_os("SNOWRDMA_BENCH_PERF_CTL")?;
            let ack = std::env::var_os("SNOWRDMA_BENCH_PERF_ACK")?;
            // perf holds both open for reading and writing: neither open
            // waits for the other end.
            let at = |file: File, fd: i32| -> std::io::Result<File> {
                // SAFETY: duplicates a descriptor we own onto one nobody
                // else uses in the bench; the copy is owned by the result.
                if unsafe { libc::dup2(file.as_raw_fd(), fd) } < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // SAFETY: `fd` was just made a copy of an open FIFO.
                Ok(unsafe { File::from_raw_fd(fd) })
            };
            let opened = std::fs::OpenOptions::new()
                .write(true)
                .open(ctl)
                .and_then(|f| at(f, PERF_CTL_FD))
                .and_then(|c| Ok((c, at(File::open(ack)?, PERF_ACK_FD)?)));
            opened
                .map_err(|e| eprintln!("bench: cannot open perf's FIFOs: {e}"))
                .ok()
        })
        .as_ref()
}

/// Sends `command` to perf's control FIFO and waits for its "ack".
fn perf_control(command: &str) {
    let Some((ctl, ack)) = perf_fifos() else {
        return;
    };
    let mut line = [0u8; 16];
    let len = command.len() + 1;
    line[..command.len()].copy_from_slice(command.as_bytes());
    line[command.len()] = b'\n';
    let acked = (&*ctl).write_all(&line[..len]).and_then(|()| {
        let mut buf = [0u8; 4];
        std::io::Read::read_exact(&mut &*ack, &mut buf)
    });
    if let Err(e) = acked {
        eprintln!("bench: perf did not take {command:?}: {e}");
    }
}

fn diff(now: &Counts, then: &Counts) -> Vec<(&'static str, u64)> {
    let lib = now.lib.since(&then.lib);
    let mut v: Vec<(&'static str, u64)> = Counter::ALL
        .iter()
        .map(|&c| (c.name(), lib.get(c)))
        .collect();
    v.push(("allocs", now.allocs.wrapping_sub(then.allocs)));
    v.push(("frees", now.frees.wrapping_sub(then.frees)));
    v
}

fn minus(a: &[(&'static str, u64)], b: &[(&'static str, u64)]) -> Vec<(&'static str, u64)> {
    a.iter()
        .zip(b)
        .map(|(&(n, x), &(_, y))| (n, x.saturating_sub(y)))
        .collect()
}
