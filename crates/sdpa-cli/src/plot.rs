//! SVG charts of bench records: TFLOP/s per problem, one bar per backend of ours and per anchor,
//! with the 95% interval of the median as a whisker where the record has one.

use plotters::prelude::*;
use serde_json::Value;
use std::path::Path;

/// The highest TFLOP/s a bar or whisker may show: a thousand times the dense peak of any GPU
/// made (an H200 is near 2,000 in FP8). Beyond it a record is corrupt, and near f64::MAX the
/// axis arithmetic overflows to infinity, on which plotters never finishes.
pub const MAX_TFLOPS: f64 = 1e6;
/// The lowest: 1 kFLOP/s, slower than any machine (the CPU reference on the smallest problem
/// runs near 1e-3). Below it a record is corrupt, and the axis's tick arithmetic degenerates.
pub const MIN_TFLOPS: f64 = 1e-9;
/// The longest label drawn or printed, in characters; longer text is cut with "...".
const MAX_LABEL: usize = 60;

/// Text from a record, safe to print on a terminal or draw into an SVG: control characters
/// (escape sequences, newlines, bell), bidirectional overrides and other invisible format
/// characters become `\u{..}` escapes, and the text is cut to `MAX_LABEL` characters.
pub fn clean(s: &str) -> String {
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i == MAX_LABEL {
            out.push_str("...");
            break;
        }
        let invisible = matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}'
            | '\u{2060}'..='\u{206f}' | '\u{feff}');
        if c.is_control() || invisible {
            out.push_str(&format!("\\u{{{:x}}}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    out
}

/// One bar: a backend's (or an anchor's) throughput on one problem.
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    /// The problem's label (x axis).
    pub problem: String,
    /// The backend or anchor (legend).
    pub series: String,
    /// TFLOP/s at the median.
    pub tflops: f64,
    /// TFLOP/s at the ends of the median's 95% interval.
    pub ci: Option<(f64, f64)>,
    /// An anchor (drawn in warm colours), not one of ours (cool colours).
    pub anchor: bool,
}

/// The shape of a record: what ours and the anchors' records are matched on.
pub type Key = (u64, u64, u64, u64, u64, bool, String);

/// The key of a bench or anchor record (`None`: a field is missing).
pub fn key(r: &Value) -> Option<Key> {
    let n = |f: &str| r[f].as_u64();
    Some((
        n("batch")?,
        n("heads")?,
        n("seq_q")?,
        n("seq_k")?,
        n("head_dim")?,
        r["causal"].as_bool()?,
        r["dtype"].as_str()?.to_string(),
    ))
}

/// A problem's label: its name where the record has one, else its shape; then its dtype
/// ([`record_dtype`]: fast and accurate e4m3 records are apart).
pub fn label(r: &Value) -> String {
    match (r["name"].as_str().map(clean), key(r)) {
        (Some(name), Some(_)) => format!("{name} {}", record_dtype(r)),
        (None, Some((b, h, sq, sk, d, causal, _))) => format!(
            "B{b} H{h} {sq}x{sk} D{d}{} {}",
            if causal { " causal" } else { "" },
            record_dtype(r)
        ),
        _ => "?".into(),
    }
}

/// A record's dtype as tables show it: with `/fast` where it ran in the fast FP8 mode (records
/// without the field, the anchors' among them, are as their dtype says).
pub fn record_dtype(r: &Value) -> String {
    let dtype = clean(r["dtype"].as_str().unwrap_or(""));
    match r["fp8_mode"].as_str() {
        Some("fast") => format!("{dtype}/fast"),
        _ => dtype.to_string(),
    }
}

/// The bar of record `r` under `problem`: `Ok(None)` when the record has no TFLOP/s figure (or
/// no time to draw it from), an error naming the field when a figure is there but is not a
/// number between `MIN_TFLOPS` and `MAX_TFLOPS` (its interval's ends included).
pub fn bar(r: &Value, problem: &str, anchor: bool) -> Result<Option<Bar>, String> {
    let (tflops, us) = match (&r["tflops"], &r["us_graph"]) {
        (Value::Null, _) | (_, Value::Null) => return Ok(None),
        (t, u) => (
            t.as_f64().ok_or(format!("tflops {t} is not a number"))?,
            u.as_f64().ok_or(format!("us_graph {u} is not a number"))?,
        ),
    };
    if !in_range(tflops) {
        return Err(format!(
            "tflops {tflops:e} is outside {MIN_TFLOPS:e}..={MAX_TFLOPS:e}"
        ));
    }
    if !(us.is_finite() && us > 0.0) {
        return Err(format!("us_graph {us:e} is not a finite time above 0"));
    }
    // TFLOP/s is inversely proportional to time: the slow end of the interval is the low one.
    let ci = match &r["us_graph_ci95"] {
        Value::Null => None,
        c => {
            let end = |i: usize| c.get(i).and_then(Value::as_f64);
            let (Some(lo), Some(hi)) = (end(0), end(1)) else {
                return Err(format!("us_graph_ci95 {c} is not a pair of numbers"));
            };
            let whisker = (tflops * us / hi, tflops * us / lo);
            if !(lo > 0.0 && lo <= hi && in_range(whisker.0) && in_range(whisker.1)) {
                return Err(format!(
                    "us_graph_ci95 [{lo:e}, {hi:e}] gives TFLOP/s outside \
                     {MIN_TFLOPS:e}..={MAX_TFLOPS:e} or out of order"
                ));
            }
            Some(whisker)
        }
    };
    Ok(Some(Bar {
        problem: problem.to_string(),
        series: clean(r["backend"].as_str().unwrap_or("?")),
        tflops,
        ci,
        anchor,
    }))
}

/// Whether `x` TFLOP/s can be drawn: finite and within `MIN_TFLOPS..=MAX_TFLOPS`.
fn in_range(x: f64) -> bool {
    (MIN_TFLOPS..=MAX_TFLOPS).contains(&x)
}

const OURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(23, 190, 207),
    RGBColor(148, 103, 189),
    RGBColor(65, 68, 81),
    RGBColor(0, 90, 50),
];
const ANCHORS: [RGBColor; 5] = [
    RGBColor(255, 127, 14),
    RGBColor(214, 39, 40),
    RGBColor(188, 189, 34),
    RGBColor(227, 119, 194),
    RGBColor(140, 86, 75),
];

/// Writes a grouped bar chart of `bars` to `path` (SVG, through `output::write_text`):
/// problems along x in the order they first appear, within each our backends first, then the
/// anchors. A bar whose figures `bar` would refuse is an error here too.
pub fn write_svg(path: &Path, title: &str, bars: &[Bar]) -> sdpa::Result<()> {
    let io = |msg: String| sdpa::Error::Io {
        path: path.display().to_string(),
        msg,
    };
    let svg = render_svg(title, bars).map_err(io)?;
    crate::output::write_text(path, &svg)
}

/// The SVG text of `write_svg`'s chart.
fn render_svg(title: &str, bars: &[Bar]) -> Result<String, String> {
    if bars.is_empty() {
        return Err("no record with a TFLOP/s figure to plot".into());
    }
    for b in bars {
        let ci = b.ci.is_none_or(|(lo, hi)| in_range(lo) && in_range(hi));
        if !(in_range(b.tflops) && ci) {
            return Err(format!(
                "{} {}: TFLOP/s {:e} (interval {:?}) outside {MIN_TFLOPS:e}..={MAX_TFLOPS:e}",
                b.problem, b.series, b.tflops, b.ci
            ));
        }
    }
    let mut problems: Vec<&str> = Vec::new();
    let mut series: Vec<(&str, bool)> = Vec::new();
    for b in bars {
        if !problems.contains(&b.problem.as_str()) {
            problems.push(&b.problem);
        }
        if !series.iter().any(|(s, _)| *s == b.series) {
            series.push((&b.series, b.anchor));
        }
    }
    series.sort_by_key(|&(_, anchor)| anchor);
    // Every figure is within MIN_TFLOPS..=MAX_TFLOPS (checked above), so the axis is finite
    // and above zero; the clamp says so to the next reader.
    let top = bars
        .iter()
        .map(|b| b.ci.map_or(b.tflops, |c| c.1.max(b.tflops)))
        .fold(0.0, f64::max)
        .clamp(MIN_TFLOPS, MAX_TFLOPS)
        * 1.12;
    let width = (160 * problems.len()).max(900) as u32;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, 620)).into_drawing_area();
        draw_chart(&root, title, &problems, &series, bars, top)
            .map_err(|e| format!("drawing the chart: {e}"))?;
    }
    Ok(svg)
}

/// Draws the chart of `render_svg` on `root`.
fn draw_chart(
    root: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    title: &str,
    problems: &[&str],
    series: &[(&str, bool)],
    bars: &[Bar],
    top: f64,
) -> Result<(), String> {
    let color = |i: usize| {
        let (name, anchor) = series[i];
        let rank = series[..i].iter().filter(|s| s.1 == anchor).count();
        let c = if anchor {
            ANCHORS[rank % ANCHORS.len()]
        } else {
            OURS[rank % OURS.len()]
        };
        (name, c)
    };
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(70)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..problems.len() as f64, 0f64..top)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(problems.len() * 2 + 1)
        .x_label_formatter(&|x| {
            // Labels at the centres of the groups only.
            let i = x.floor() as usize;
            let centred = (x - x.floor() - 0.5).abs() < 1e-6;
            if centred && i < problems.len() {
                problems[i].to_string()
            } else {
                String::new()
            }
        })
        .x_label_style(("sans-serif", 13))
        .y_desc("TFLOP/s (median; whisker: 95% interval)")
        .draw()
        .map_err(|e| e.to_string())?;
    let slot = 0.8 / series.len() as f64;
    for i in 0..series.len() {
        let (name, c) = color(i);
        let offset = 0.1 + slot * i as f64;
        let mine: Vec<(f64, &Bar)> = bars
            .iter()
            .filter(|b| b.series == name)
            .map(|b| {
                let p = problems.iter().position(|&p| p == b.problem).unwrap_or(0);
                (p as f64 + offset, b)
            })
            .collect();
        chart
            .draw_series(
                mine.iter().map(|&(x, b)| {
                    Rectangle::new([(x, 0.0), (x + slot * 0.92, b.tflops)], c.filled())
                }),
            )
            .map_err(|e| e.to_string())?
            .label(name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], c.filled()));
        chart
            .draw_series(mine.iter().filter_map(|&(x, b)| {
                let (lo, hi) = b.ci?;
                let mid = x + slot * 0.46;
                Some(ErrorBar::new_vertical(
                    mid,
                    lo,
                    b.tflops,
                    hi,
                    BLACK.stroke_width(1),
                    6,
                ))
            }))
            .map_err(|e| e.to_string())?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn record(tflops: f64, us: f64, ci: Value) -> Value {
        json!({"backend": "cutlass", "tflops": tflops, "us_graph": us, "us_graph_ci95": ci})
    }

    /// Figures no axis can hold are refused, naming the field; a record without a figure has
    /// no bar and no complaint.
    #[test]
    fn bars_refuse_figures_outside_the_drawable_range() {
        let ok = bar(&record(630.0, 872.0, json!([860.0, 880.0])), "p", false).unwrap();
        let (lo, hi) = ok.unwrap().ci.unwrap();
        assert!(lo < 630.0 && 630.0 < hi);
        let cases = [
            (
                record(1.7e308, 1e-300, Value::Null),
                "tflops 1.7e308 is outside",
            ),
            (record(0.0, 1.0, Value::Null), "tflops 0e0 is outside"),
            (record(-3.0, 1.0, Value::Null), "tflops -3e0 is outside"),
            (record(1e-12, 1.0, Value::Null), "tflops 1e-12 is outside"),
            (
                record(600.0, 800.0, json!([1e-307, 801.0])),
                "us_graph_ci95 [1e-307",
            ),
            (record(600.0, 800.0, json!([900.0, 700.0])), "out of order"),
            (record(600.0, 800.0, json!([0.0, 801.0])), "us_graph_ci95"),
            (
                record(600.0, 800.0, json!(["a", 801.0])),
                "not a pair of numbers",
            ),
            (
                record(600.0, 0.0, Value::Null),
                "us_graph 0e0 is not a finite time",
            ),
            (
                json!({"tflops": "fast", "us_graph": 1.0}),
                "is not a number",
            ),
        ];
        for (r, fragment) in cases {
            let e = bar(&r, "p", false).unwrap_err();
            assert!(e.contains(fragment), "{r}: {e}");
        }
        assert_eq!(
            bar(&json!({"backend": "x", "us_graph": 1.0}), "p", false),
            Ok(None)
        );
    }

    /// Charts at both ends of the drawable range are drawn at once (plotters' tick arithmetic
    /// never meets an infinite or vanishing axis); a bar outside it is an error, not a hang.
    #[test]
    fn charts_at_the_ends_of_the_range_are_drawn_at_once() {
        let b = |tflops: f64, ci: Option<(f64, f64)>| Bar {
            problem: "p".into(),
            series: "s".into(),
            tflops,
            ci,
            anchor: false,
        };
        for bars in [
            vec![b(MAX_TFLOPS, Some((MIN_TFLOPS, MAX_TFLOPS)))],
            vec![b(MIN_TFLOPS, Some((MIN_TFLOPS, MIN_TFLOPS)))],
            vec![b(MIN_TFLOPS, None), b(MAX_TFLOPS, None)],
        ] {
            let t0 = std::time::Instant::now();
            let svg = render_svg("t", &bars).unwrap();
            assert!(svg.starts_with("<svg"));
            assert!(t0.elapsed() < std::time::Duration::from_secs(5), "{bars:?}");
        }
        for bad in [
            b(f64::MAX, None),
            b(1.0, Some((1e-307, 1.0))),
            b(f64::NAN, None),
        ] {
            assert!(render_svg("t", &[bad]).is_err());
        }
    }

    #[test]
    fn record_text_is_cleaned_for_terminals_and_charts() {
        assert_eq!(clean("H100 80GB"), "H100 80GB");
        assert_eq!(clean("Tesla\u{2122} µ"), "Tesla\u{2122} µ");
        assert_eq!(
            clean("a\u{1b}[31m\nb\u{7}\u{202e}\u{9f}"),
            "a\\u{1b}[31m\\u{a}b\\u{7}\\u{202e}\\u{9f}"
        );
        let long = "x".repeat(100);
        assert_eq!(clean(&long), format!("{}...", "x".repeat(MAX_LABEL)));
    }
}
