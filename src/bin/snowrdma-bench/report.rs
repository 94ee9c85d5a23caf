//! The report: every case beside its reference, with the target column,
//! printed and written as JSON.

use std::collections::BTreeMap;
use std::path::PathBuf;

/// One row of the report: what is compared with what, and which way is better.
struct Row {
    case: &'static str,
    what: &'static str,
    reference: &'static str,
    unit: &'static str,
    higher_is_better: bool,
    target: &'static str,
}

const ROWS: &[Row] = &[
    Row {
        case: "write_lat",
        what: "verbs RDMA WRITE 64 B, half RTT",
        reference: "ib_write_lat",
        unit: "us",
        higher_is_better: false,
        target: "<= 1.05",
    },
    Row {
        case: "read_lat",
        what: "verbs RDMA READ 64 B",
        reference: "ib_read_lat",
        unit: "us",
        higher_is_better: false,
        target: "<= 1.05",
    },
    Row {
        case: "cas_lat",
        what: "verbs atomic CAS",
        reference: "ib_atomic_lat",
        unit: "us",
        higher_is_better: false,
        target: "<= 1.05",
    },
    Row {
        case: "sync_read",
        what: "rdmaSyncReadSignaled 64 B",
        reference: "ib_read_lat",
        unit: "us",
        higher_is_better: false,
        target: "<= 1.10",
    },
    Row {
        case: "sync_write",
        what: "rdmaSyncWriteSignaled 64 B",
        reference: "verbs signaled WRITE",
        unit: "us",
        higher_is_better: false,
        target: "<= 1.10",
    },
    Row {
        case: "imm_lat",
        what: "verbs WRITE WITH IMM 64 B, half RTT",
        reference: "ib_send_lat",
        unit: "us",
        higher_is_better: false,
        target: "reported",
    },
    Row {
        case: "echo_lat",
        what: "rdmaConnSend echo 64 B, half RTT",
        reference: "ib_send_lat",
        unit: "us",
        higher_is_better: false,
        target: "<= 1.30",
    },
    Row {
        case: "echo_legacy_lat",
        what: "rdmaConnSend echo 64 B vs legacy-protocol peer, 2 procs",
        reference: "echo_server, 2 procs",
        unit: "us",
        higher_is_better: false,
        target: "<= 1.0",
    },
    Row {
        case: "stream_bw",
        what: "rdmaConnSend stream 64 KiB",
        reference: "ib_write_bw",
        unit: "MiB/s",
        higher_is_better: true,
        target: ">= 0.90",
    },
    Row {
        case: "msg_rate",
        what: "rdmaConnSend 64 B message rate",
        reference: "ib_write_bw -s 64",
        unit: "Mpps",
        higher_is_better: true,
        target: ">= 0.80",
    },
    Row {
        case: "kv_get_lat",
        what: "kv GET 16 B key, 64 B value (full RTT)",
        reference: "ib_send_lat (half RTT)",
        unit: "us",
        higher_is_better: false,
        target: "<= 2.30",
    },
    Row {
        case: "kv_get_lat_crowd",
        what: "kv GET as above, 127 more clients connected",
        reference: "ib_send_lat (half RTT)",
        unit: "us",
        higher_is_better: false,
        target: "reported",
    },
    Row {
        case: "kv_put_lat",
        what: "kv PUT 16 B key, 64 B value (full RTT)",
        reference: "ib_send_lat (half RTT)",
        unit: "us",
        higher_is_better: false,
        target: "<= 2.30",
    },
    Row {
        case: "kv_onesided_lat",
        what: "kv one-sided GET 64 B (1 READ)",
        reference: "ib_read_lat",
        unit: "us",
        higher_is_better: false,
        target: "<= 2.20",
    },
    Row {
        case: "kv_get_bw",
        what: "kv batch_get 64 KiB, 32 per batch",
        reference: "ib_read_bw",
        unit: "MiB/s",
        higher_is_better: true,
        target: ">= 0.80",
    },
    Row {
        case: "kv_onesided_get_bw",
        what: "kv one-sided batch GET 64 KiB, 32 per batch",
        reference: "ib_read_bw",
        unit: "MiB/s",
        higher_is_better: true,
        target: ">= 0.80",
    },
    Row {
        case: "kv_put_bw",
        what: "kv batch_put 64 KiB, 32 per batch",
        reference: "ib_write_bw",
        unit: "MiB/s",
        higher_is_better: true,
        target: ">= 0.80",
    },
    Row {
        case: "kv_mix",
        what: "kv 95/5 GET/PUT 64 B, 4 clients",
        reference: "ib_send_bw -s 64 (Mpps)",
        unit: "Mops",
        higher_is_better: true,
        target: "reported",
    },
    Row {
        case: "kv_app_write_1024",
        what: "kv_set+kv_get 1 KiB (menu 3)",
        reference: "ib_write_bw 1 KiB",
        unit: "MB/s",
        higher_is_better: true,
        target: "reported",
    },
    Row {
        case: "kv_app_read_1024",
        what: "kv_set+kv_get 1 KiB (menu 3)",
        reference: "ib_read_bw 1 KiB",
        unit: "MB/s",
        higher_is_better: true,
        target: "reported",
    },
    Row {
        case: "kv_app_write_65536",
        what: "kv_set+kv_get 64 KiB (menu 3)",
        reference: "ib_write_bw 64 KiB",
        unit: "MB/s",
        higher_is_better: true,
        target: "reported",
    },
    Row {
        case: "kv_app_read_65536",
        what: "kv_set+kv_get 64 KiB (menu 3)",
        reference: "ib_read_bw 64 KiB",
        unit: "MB/s",
        higher_is_better: true,
        target: "reported",
    },
    Row {
        case: "kv_app_write_16777216",
        what: "kv_set+kv_get 16 MiB (menu 3)",
        reference: "ib_write_bw 16 MiB",
        unit: "MB/s",
        higher_is_better: true,
        target: "reported",
    },
    Row {
        case: "kv_app_read_16777216",
        what: "kv_set+kv_get 16 MiB (menu 3)",
        reference: "ib_read_bw 16 MiB",
        unit: "MB/s",
        higher_is_better: true,
        target: "reported",
    },
];

/// "median [min-max]" with enough digits for small figures (Mpps).
fn spread(med: f64, min: f64, max: f64) -> String {
    let digits = if med < 1.0 { 4 } else { 2 };
    format!("{med:.digits$} [{min:.digits$}-{max:.digits$}]")
}

fn stats(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

pub(crate) fn report(results: &PathBuf, json: &PathBuf) -> std::io::Result<()> {
    let text = std::fs::read_to_string(results)?;
    let mut data: BTreeMap<(String, String), Vec<f64>> = BTreeMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if let [case, side, value] = f[..] {
            if let Ok(v) = value.parse::<f64>() {
                data.entry((case.to_string(), side.to_string()))
                    .or_default()
                    .push(v);
            }
        }
    }
    // Columns as wide as their longest entry, so every row lines up.
    let w = ROWS.iter().map(|r| r.what.len()).max().unwrap_or(0);
    let rw = ROWS.iter().map(|r| r.reference.len()).max().unwrap_or(0);
    println!(
        "{:<w$} {:<rw$} {:>23} {:>23} {:>7}  {:>7}",
        "case", "reference", "reference med [min-max]", "snowrdma med [min-max]", "ratio", "target"
    );
    let mut out = Vec::new();
    for row in ROWS {
        let mut r = data
            .get(&(row.case.into(), "reference".into()))
            .cloned()
            .unwrap_or_default();
        let mut o = data
            .get(&(row.case.into(), "snowrdma".into()))
            .cloned()
            .unwrap_or_default();
        if r.is_empty() || o.is_empty() {
            println!(
                "{:<w$} {:<rw$} (missing: a run failed, see the log)",
                row.what, row.reference
            );
            continue;
        }
        let (rm, rmin, rmax) = stats(&mut r);
        let (om, omin, omax) = stats(&mut o);
        let ratio = om / rm;
        println!(
            "{:<w$} {:<rw$} {:>23} {:>23} {:>7.2}  {:>7} {}",
            row.what,
            row.reference,
            spread(rm, rmin, rmax),
            spread(om, omin, omax),
            ratio,
            row.target,
            row.unit
        );
        out.push(format!(
            "{{\"case\":\"{}\",\"what\":\"{}\",\"reference\":\"{}\",\"unit\":\"{}\",\"higher_is_better\":{},\"target\":\"{}\",\
             \"reference_median\":{rm},\"reference_min\":{rmin},\"reference_max\":{rmax},\"reference_runs\":{},\
             \"snowrdma_median\":{om},\"snowrdma_min\":{omin},\"snowrdma_max\":{omax},\"snowrdma_runs\":{},\"ratio\":{ratio}}}",
            row.case, row.what, row.reference, row.unit, row.higher_is_better, row.target, r.len(), o.len()
        ));
    }
    if let Some(dir) = json.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(json, format!("[\n  {}\n]\n", out.join(",\n  ")))?;
    println!(
        "ratio = snowrdma / reference (medians of interleaved runs); JSON: {}",
        json.display()
    );
    Ok(())
}
