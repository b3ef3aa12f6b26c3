//! `sdpa compare OURS.json ANCHORS.json`: each of our bench records against the fastest anchor
//! on the same problem (speedup = anchor's us_graph / ours; above 1, ours is faster), and with
//! `--plot` a chart of both.

use crate::input::read_records;
use crate::plot::{self, Bar, Key, clean, key, label};
use crate::{CliResult, Failure, output};
use serde_json::Value;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Our records (`sdpa bench --json`).
    ours: PathBuf,
    /// The anchors' records (shared/anchors/sdpa_anchor.py --json: torch SDPA backends, fa4).
    anchors: PathBuf,
    /// Also draw every backend and anchor per problem into this SVG file.
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// One line of the table: our record, the fastest anchor on its problem (if any) and the
/// speedup over it.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub problem: String,
    pub ours: String,
    pub us: f64,
    pub anchor: Option<(String, f64)>,
}

impl Row {
    /// The anchor's time over ours (above 1: ours is faster).
    pub fn speedup(&self) -> Option<f64> {
        self.anchor.as_ref().map(|(_, us)| us / self.us)
    }
}

/// The fastest anchor record per problem. e4m3 rows of ours are matched against bf16 anchors
/// where no e4m3 anchor exists (as compare.py does).
fn fastest(anchors: &[Value]) -> HashMap<Key, &Value> {
    let mut best: HashMap<Key, &Value> = HashMap::new();
    for r in anchors {
        let (Some(k), Some(us)) = (key(r), r["us_graph"].as_f64()) else {
            continue;
        };
        let faster = best
            .get(&k)
            .is_none_or(|b| us < b["us_graph"].as_f64().unwrap_or(f64::INFINITY));
        if faster {
            best.insert(k, r);
        }
    }
    best
}

fn anchor_for<'a>(best: &HashMap<Key, &'a Value>, k: &Key) -> Option<&'a Value> {
    best.get(k).copied().or_else(|| {
        let mut k16 = k.clone();
        k16.6 = "bf16".into();
        (k.6 == "e4m3").then(|| best.get(&k16).copied()).flatten()
    })
}

/// The table's rows, in the order of our records.
pub fn rows(ours: &[Value], anchors: &[Value]) -> Vec<Row> {
    let best = fastest(anchors);
    ours.iter()
        .filter_map(|r| {
            let k = key(r)?;
            let us = r["us_graph"].as_f64()?;
            let anchor = anchor_for(&best, &k).map(|a| {
                let name = clean(a["backend"].as_str().unwrap_or("?"));
                (name, a["us_graph"].as_f64().unwrap_or(f64::NAN))
            });
            Some(Row {
                problem: label(r),
                ours: clean(r["backend"].as_str().unwrap_or("?")),
                us,
                anchor,
            })
        })
        .collect()
}

/// The bars of our records and of every anchor record on the same problems, labelled by ours,
/// and a note for each record left out of the chart for figures it cannot draw (see
/// `plot::bar`).
pub fn bars(ours: &[Value], anchors: &[Value]) -> (Vec<Bar>, Vec<String>) {
    let mut labels: Vec<(Key, String)> = Vec::new();
    let (mut out, mut notes) = (Vec::new(), Vec::new());
    let mut add = |which: &str, i: usize, r: &Value, name: &str, anchor: bool| match plot::bar(
        r, name, anchor,
    ) {
        Ok(b) => out.extend(b),
        Err(why) => notes.push(format!(
            "{which}[{i}] ({name} {}): left out of the chart: {why}",
            clean(r["backend"].as_str().unwrap_or("?"))
        )),
    };
    for (i, r) in ours.iter().enumerate() {
        let Some(k) = key(r) else { continue };
        let name = label(r);
        if !labels.iter().any(|(l, _)| *l == k) {
            labels.push((k, name.clone()));
        }
        add("ours", i, r, &name, false);
    }
    for (k, name) in &labels {
        for (i, a) in anchors.iter().enumerate() {
            if key(a).as_ref() == Some(k) {
                add("anchors", i, a, name, true);
            }
        }
    }
    (out, notes)
}

pub fn main(a: Args) -> CliResult<ExitCode> {
    if let Some(plot) = &a.plot {
        let inputs = [("OURS", a.ours.as_path()), ("ANCHORS", a.anchors.as_path())];
        output::check(&[("--plot", plot)], &inputs)?;
    }
    let ours = read_records(&a.ours)?;
    let anchors = read_records(&a.anchors)?;
    let table = rows(&ours, &anchors);
    outln!(
        "{:<28} {:<13} {:>10} {:<14} {:>10} {:>8}",
        "problem",
        "ours",
        "us",
        "best anchor",
        "us",
        "speedup"
    )?;
    for r in &table {
        match (&r.anchor, r.speedup()) {
            (Some((name, us)), Some(s)) => outln!(
                "{:<28} {:<13} {:>10.2} {:<14} {:>10.2} {:>7.2}x",
                r.problem,
                r.ours,
                r.us,
                name,
                us,
                s
            )?,
            _ => outln!(
                "{:<28} {:<13} {:>10.2} (no anchor)",
                r.problem,
                r.ours,
                r.us
            )?,
        }
    }
    if let Some(path) = &a.plot {
        let device = clean(
            ours.iter()
                .find_map(|r| r["device"].as_str())
                .unwrap_or("unknown device"),
        );
        let title =
            format!("sdpa and anchors on {device}: TFLOP/s from us_graph (higher is better)");
        let (bars, notes) = bars(&ours, &anchors);
        for n in notes {
            note!("sdpa compare: {n}");
        }
        plot::write_svg(path, &title, &bars).map_err(Failure::from)?;
        outln!("wrote {}", path.display())?;
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::path::Path;

    fn rec(name: &str, backend: &str, us: f64, tflops: f64) -> Value {
        json!({"name": name, "batch": 1, "heads": 16, "seq_q": 8192, "seq_k": 8192,
               "head_dim": 128, "causal": false, "dtype": "bf16", "backend": backend,
               "us_graph": us, "tflops": tflops, "us_graph_ci95": [us * 0.99, us * 1.01]})
    }

    #[test]
    fn each_record_of_ours_meets_the_fastest_anchor_of_its_problem() {
        let ours = [rec("s8k-d128", "cutlass", 872.0, 630.0)];
        let anchors = [
            rec("s8k-d128", "torch-cudnn", 905.0, 607.0),
            rec("s8k-d128", "fa4", 800.0, 687.0),
        ];
        let t = rows(&ours, &anchors);
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].anchor, Some(("fa4".to_string(), 800.0)));
        let s = t[0].speedup().unwrap();
        assert!((s - 800.0 / 872.0).abs() < 1e-12, "{s}");
        assert_eq!(t[0].problem, "s8k-d128 bf16");
        let mut e4 = rec("s8k-d128", "cutlass", 700.0, 780.0);
        e4["dtype"] = json!("e4m3");
        assert_eq!(
            rows(&[e4], &anchors)[0].anchor,
            Some(("fa4".to_string(), 800.0)),
            "e4m3 meets the bf16 anchors"
        );
        assert_eq!(rows(&ours, &[])[0].anchor, None);
        // A fast FP8 record: its own label, the same anchors.
        let mut fast = rec("s8k-d128", "cutlass", 500.0, 1000.0);
        fast["dtype"] = json!("e4m3");
        fast["fp8_mode"] = json!("fast");
        let t = rows(&[fast], &anchors);
        assert_eq!(t[0].problem, "s8k-d128 e4m3/fast");
        assert_eq!(t[0].anchor, Some(("fa4".to_string(), 800.0)));
    }

    #[test]
    fn the_chart_holds_every_problem_and_series() {
        let ours = [
            rec("s8k-d128", "cutlass", 872.0, 630.0),
            rec("s8k-d128", "cutlass-sm80", 1500.0, 366.0),
        ];
        let anchors = [rec("s8k-d128", "fa4", 800.0, 687.0)];
        let (b, notes) = bars(&ours, &anchors);
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(b.len(), 3);
        assert!(b[2].anchor && !b[0].anchor);
        let (lo, hi) = b[0].ci.unwrap();
        assert!(lo < 630.0 && 630.0 < hi, "{lo} {hi}");
        let path = std::env::temp_dir().join(format!("sdpa-chart-{}.svg", std::process::id()));
        plot::write_svg(&path, "test", &b).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..40.min(svg.len())]);
        for text in ["s8k-d128 bf16", "cutlass", "cutlass-sm80", "fa4"] {
            assert!(svg.contains(text), "the chart lacks {text}");
        }
    }

    #[test]
    fn unreadable_files_are_errors_naming_them() {
        let e = read_records(Path::new("/nonexistent/ours.json")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/ours.json"), "{e}");
        let path = std::env::temp_dir().join(format!("sdpa-bad-{}.json", std::process::id()));
        std::fs::write(&path, "{\"not\": \"a list\"}").unwrap();
        let e = read_records(&path).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert!(e.to_string().contains("not a JSON list"), "{e}");
        let e = plot::write_svg(Path::new("/tmp/x.svg"), "t", &[]).unwrap_err();
        assert!(e.to_string().contains("no record"), "{e}");
    }

    /// Records whose figures cannot be drawn are left out of the chart with a note naming them;
    /// the rest are drawn.
    #[test]
    fn records_the_chart_cannot_hold_are_left_out_with_a_note() {
        let ours = [
            rec("s8k-d128", "cutlass", 872.0, 630.0),
            rec("s8k-d128", "wmma", 1e-300, 1.7e308),
        ];
        let mut anchor = rec("s8k-d128", "fa4", 800.0, 687.0);
        anchor["us_graph_ci95"] = json!([1e-307, 801.0]);
        let (b, notes) = bars(&ours, &[anchor]);
        assert_eq!(b.len(), 1);
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(
            notes[0].starts_with("ours[1] (s8k-d128 bf16 wmma)"),
            "{}",
            notes[0]
        );
        assert!(
            notes[1].starts_with("anchors[0] (s8k-d128 bf16 fa4)"),
            "{}",
            notes[1]
        );
    }
}
