//! The report: every case beside its reference, with the target column, in
//! the order of the list of cases, printed and written as JSON.

use std::collections::BTreeMap;
use std::path::PathBuf;

use super::cases::CASES;
use super::cost_report::cost_report;

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
    let w = CASES.iter().map(|r| r.what.len()).max().unwrap_or(0);
    let rw = CASES
        .iter()
        .map(|r| r.reference_label.len())
        .max()
        .unwrap_or(0);
    println!(
        "{:<w$} {:<rw$} {:>23} {:>23} {:>7}  {:>7}",
        "case", "reference", "reference med [min-max]", "snowrdma med [min-max]", "ratio", "target"
    );
    let mut out = Vec::new();
    for row in CASES {
        let mut r = data
            .get(&(row.name.into(), "reference".into()))
            .cloned()
            .unwrap_or_default();
        let mut o = data
            .get(&(row.name.into(), "snowrdma".into()))
            .cloned()
            .unwrap_or_default();
        if r.is_empty() || o.is_empty() {
            println!(
                "{:<w$} {:<rw$} (missing: a run failed, see the log)",
                row.what, row.reference_label
            );
            continue;
        }
        let (rm, rmin, rmax) = stats(&mut r);
        let (om, omin, omax) = stats(&mut o);
        let ratio = om / rm;
        println!(
            "{:<w$} {:<rw$} {:>23} {:>23} {:>7.2}  {:>7} {}",
            row.what,
            row.reference_label,
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
            row.name, row.what, row.reference_label, row.unit, row.higher_is_better, row.target, r.len(), o.len()
        ));
    }
    println!("ratio = snowrdma / reference (medians of interleaved runs)");
    let costs = cost_report(&results.with_extension("costs"));
    if let Some(dir) = json.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(
        json,
        format!(
            "{{\n\"cases\": [\n  {}\n],\n\"costs\": [\n  {}\n]\n}}\n",
            out.join(",\n  "),
            costs.join(",\n  ")
        ),
    )?;
    println!("JSON: {}", json.display());
    Ok(())
}
