//! What a benchmark case is: what it compares, how each side is measured,
//! and how the report shows it (the list itself: `case_table`).
//! `snowrdma-bench cases` prints the list for `scripts/bench.sh` (which runs
//! the perftest programs and the servers in their own processes), `run`
//! measures the sides measured here and `report` prints the table in the
//! list's order.

pub(crate) use super::case_table::CASES;

/// A measurement in this program: (iterations, size, port) to its figure.
pub(crate) type Run = fn(usize, usize, u16) -> f64;

/// How one side of a case is measured.
pub(crate) enum Measure {
    /// A perftest program's server and client on the device; the figure is
    /// field `column` of the client's result line.
    Perftest {
        tool: &'static str,
        column: u8,
        args: &'static str,
        /// The figure is multiplied by this (1, or 0.5 where one of our
        /// operations is two of perftest's messages).
        scale: f64,
    },
    /// Here: `snowrdma-bench run <case> <side>`.
    Here { run: Run, size: usize, iters: usize },
    /// Here, against a server the script starts in its own process first:
    /// `server`, in which the script puts the device's address for IP, a
    /// fresh port for PORT and this program for BENCH.
    AgainstServer {
        server: &'static str,
        run: Run,
        size: usize,
        iters: usize,
    },
    /// A `kv_server` process and `clients` `kv_client` processes (`mix`
    /// command, `ops` each), connected and seeded before the clock starts;
    /// the figure is million operations per second of them all, and the
    /// server's CPU time per operation goes to the cost report.
    KvProcs { clients: usize, ops: usize },
    /// The kv_open application's `client` menu option 3 (SET+GET pairs of 1
    /// B to 16 MiB), which the script runs once: its figure at `size`, MB/s.
    KvAppMenu { size: usize },
}

/// When the script measures a case.
#[derive(PartialEq, Eq)]
pub(crate) enum Schedule {
    /// In each of the SNOWRDMA_BENCH_REPS repetitions, interleaved with the
    /// other cases, reference then snowrdma.
    EachRepetition,
    /// Once, after the repetitions (the kv_open menu takes minutes).
    Once,
}

pub(crate) struct Case {
    /// The name in the results file and the JSON.
    pub name: &'static str,
    /// What the snowrdma side measures, as the table says it.
    pub what: &'static str,
    /// What the reference side is, as the table says it.
    pub reference_label: &'static str,
    pub unit: &'static str,
    pub higher_is_better: bool,
    /// The ratio snowrdma / reference aimed at, or "reported".
    pub target: &'static str,
    pub schedule: Schedule,
    pub reference: Measure,
    pub snowrdma: Measure,
}

pub(crate) const fn perftest(tool: &'static str, column: u8, args: &'static str) -> Measure {
    Measure::Perftest {
        tool,
        column,
        args,
        scale: 1.0,
    }
}

/// A kv operation rate at `clients` client processes beside half of
/// `ib_send_bw -s 64 -q <clients>`'s message rate (an operation is a request
/// and a reply).
pub(crate) const fn kv_procs(
    name: &'static str,
    what: &'static str,
    args: &'static str,
    clients: usize,
) -> Case {
    Case {
        name,
        what,
        reference_label: "half ib_send_bw -s 64 -q N",
        unit: "Mops",
        higher_is_better: true,
        target: ">= 0.70",
        schedule: Schedule::EachRepetition,
        reference: Measure::Perftest {
            tool: "ib_send_bw",
            column: 5,
            args,
            scale: 0.5,
        },
        snowrdma: Measure::KvProcs {
            clients,
            ops: 20000,
        },
    }
}

pub(crate) const fn here(run: Run, size: usize, iters: usize) -> Measure {
    Measure::Here { run, size, iters }
}

/// Measured here against `server`, which the script starts in a process of
/// its own first (IP, PORT and BENCH filled in).
pub(crate) const fn against(server: &'static str, run: Run, size: usize, iters: usize) -> Measure {
    Measure::AgainstServer {
        server,
        run,
        size,
        iters,
    }
}

/// A latency case run in each repetition (lower is better, microseconds).
pub(crate) const fn lat(
    name: &'static str,
    what: &'static str,
    reference_label: &'static str,
    target: &'static str,
    reference: Measure,
    snowrdma: Measure,
) -> Case {
    Case {
        name,
        what,
        reference_label,
        unit: "us",
        higher_is_better: false,
        target,
        schedule: Schedule::EachRepetition,
        reference,
        snowrdma,
    }
}

/// A throughput case run in each repetition (higher is better).
pub(crate) const fn bw(
    name: &'static str,
    what: &'static str,
    reference_label: &'static str,
    unit: &'static str,
    target: &'static str,
    reference: Measure,
    snowrdma: Measure,
) -> Case {
    Case {
        name,
        what,
        reference_label,
        unit,
        higher_is_better: true,
        target,
        schedule: Schedule::EachRepetition,
        reference,
        snowrdma,
    }
}

/// The kv_open application's throughput at `size` beside a perftest
/// bandwidth program at the same size, once.
pub(crate) const fn kv_app(
    name: &'static str,
    what: &'static str,
    reference_label: &'static str,
    tool: &'static str,
    args: &'static str,
    size: usize,
) -> Case {
    Case {
        name,
        what,
        reference_label,
        unit: "MB/s",
        higher_is_better: true,
        target: "reported",
        schedule: Schedule::Once,
        reference: perftest(tool, 4, args),
        snowrdma: Measure::KvAppMenu { size },
    }
}

/// The case called `name`.
pub(crate) fn find(name: &str) -> Option<&'static Case> {
    CASES.iter().find(|c| c.name == name)
}

/// One line per side of every case, in the order to measure them, for
/// `scripts/bench.sh`:
///
/// ```text
/// <each|once> <case> <reference|snowrdma> perftest <column> <scale> <tool> <args...>
/// <each|once> <case> <reference|snowrdma> here
/// <each|once> <case> <reference|snowrdma> server <command with IP, PORT, BENCH...>
/// <each|once> <case> <reference|snowrdma> kv-procs <clients> <operations each>
/// <each|once> <case> <reference|snowrdma> kv-app-menu <size>
/// ```
///
/// `here` and `server` mean `snowrdma-bench run <case> <side> --port P`
/// (after starting the server on port P).
pub(crate) fn print_cases() {
    for case in CASES {
        let schedule = match case.schedule {
            Schedule::EachRepetition => "each",
            Schedule::Once => "once",
        };
        for (side, m) in [("reference", &case.reference), ("snowrdma", &case.snowrdma)] {
            let how = match m {
                Measure::Perftest {
                    tool,
                    column,
                    args,
                    scale,
                } => format!("perftest {column} {scale} {tool} {args}"),
                Measure::KvProcs { clients, ops } => format!("kv-procs {clients} {ops}"),
                Measure::Here { .. } => "here".to_string(),
                Measure::AgainstServer { server, .. } => format!("server {server}"),
                Measure::KvAppMenu { size } => format!("kv-app-menu {size}"),
            };
            println!("{schedule} {} {side} {how}", case.name);
        }
    }
}
